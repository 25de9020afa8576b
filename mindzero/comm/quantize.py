"""The graph kernels of a quantized stage-3 gather (the format and its numpy twin: :mod:`mindzero.core.quant`).

MindSpore has no bit-cast operator, so the IEEE bytes of each fp32 scale are computed arithmetically
(exponent from ``log2`` corrected against an exact table of powers of two; mantissa by exact power-of-two
scaling) and the int8 bytes are packed into int32 words arithmetically: the same bytes, bit for bit, as the
numpy twin's ``view``.

Everything the size of a weight is computed in float32 kernels (bytes are float32 values in [-128, 127],
exact), never with integer arithmetic, ``Div`` or broadcasting against a column: MindSpore's CPU kernels for
those keep index tables several times the size of their output for the life of the compiled graph, where
float32 ``RealDiv``, ``Mul``, ``Floor``, ``Round``, ``Cast``, ``Tile`` and ``Stack`` keep their output only
(``benchmarks/cpu_kernel_memory.py`` measures each). Only the scales (one per block) use integer kernels.
"""
from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops


from ..core.quant import MIN_NORMAL, QMAX
from .shard_gather import GradientPort, StopGradient

_POW2 = Tensor(np.array([2.0 ** k for k in range(-126, 128)], np.float32))  # exact: 2**k at index k + 126
_TWO23 = 1 << 23
_REAL_DIV = ops.RealDiv()


@ms.jit_class
class ByteKernels:
    """Bytes <-> int32 words in float arithmetic, with primitive instances of its own (so that a
    :class:`Decoder`'s ``recompute()`` marks exactly its own). Bytes are signed (float32 values in [-128, 127]);
    words are little-endian int32."""

    def __init__(self):
        self.cast, self.reshape, self.add = ops.Cast(), ops.Reshape(), ops.Add()
        self.sub, self.mul = ops.Sub(), ops.Mul()
        self.floor, self.round, self.stack, self.split = ops.Floor(), ops.Round(), ops.Stack(1), ops.Split(1, 4)

    def prims(self):
        return [self.cast, self.reshape, self.add, self.sub, self.mul, self.floor, self.round, self.stack, self.split]

    def signed(self, b):
        """[0, 255] -> [-128, 127] (two's complement)."""
        return self.sub(b, self.mul(self.floor(self.mul(b, 1.0 / 128)), 256.0))

    def unsigned(self, b):
        """[-128, 127] -> [0, 255]."""
        return self.sub(b, self.mul(self.floor(self.mul(b, 1.0 / 256)), 256.0))

    def words_to_bytes(self, w):
        """int32 words (any shape) -> their signed bytes, 4 per word, flat. The low 16 bits by a wrapping cast
        to uint16; the high 16 from the word's fp32 value (off by at most 192 from a multiple of 65536: exact
        after rounding)."""
        w = self.reshape(w, (-1,))
        lo = self.cast(self.cast(w, ms.uint16), ms.float32)
        hi = self.round(self.mul(self.sub(self.cast(w, ms.float32), lo), 1.0 / 65536))
        b1 = self.floor(self.mul(lo, 1.0 / 256))
        b3 = self.floor(self.mul(hi, 1.0 / 256))
        b0, b2 = self.sub(lo, self.mul(b1, 256.0)), self.sub(hi, self.mul(b3, 256.0))
        return self.reshape(self.stack((self.signed(b0), self.signed(b1), self.signed(b2), b3)), (-1,))

    def word_values(self, b):
        """Signed bytes (any real dtype, length a multiple of 4) -> the values of their little-endian int32 words,
        as fp64 (exact): two exact 16-bit halves in fp32, joined in fp64."""
        b0, b1, b2, b3 = self.split(self.reshape(self.cast(b, ms.float32), (-1, 4)))
        lo = self.add(self.unsigned(b0), self.mul(self.unsigned(b1), 256.0))
        hi = self.add(self.unsigned(b2), self.mul(b3, 256.0))  # the top byte keeps its sign
        return self.reshape(self.add(self.mul(self.cast(hi, ms.float64), 65536.0), self.cast(lo, ms.float64)), (-1,))

    def bytes_to_words(self, b):
        """Signed bytes (any real dtype, length a multiple of 4) -> little-endian int32 words."""
        return self.cast(self.word_values(b), ms.int32)


_SHARED = ByteKernels()


def words_to_bytes(w):
    """Little-endian int32 words -> their signed bytes (float32 values in [-128, 127]), 4 per word."""
    return _SHARED.words_to_bytes(w)


def bytes_to_words(b):
    """Signed bytes (values in [-128, 127], length a multiple of 4) -> little-endian int32 words."""
    return _SHARED.bytes_to_words(b)


def quantize(x, block: int, nb: int):
    """``(q (nb * block,) float32 integers in [-127, 127], scales (nb,) float32)`` of the 1-D shard ``x``
    (computed in fp32)."""
    x = ops.cast(x, ms.float32)
    x = ops.select(ops.abs(x) >= float(MIN_NORMAL), x, ops.zeros_like(x))  # subnormals flushed on every backend
    pad = nb * block - x.shape[0]
    if pad:
        x = ops.concat((x, ops.zeros((pad,), ms.float32)))
    rows = x.reshape((nb, block))
    amax = ops.abs(rows).max(axis=1)
    scale = amax / QMAX
    scale = ops.select(amax > 0, ops.maximum(scale, float(MIN_NORMAL)), ops.zeros_like(scale))
    safe = ops.tile(ops.select(scale > 0, scale, ops.ones_like(scale)).reshape((nb, 1)), (1, block))
    q = ops.clamp(ops.round(_REAL_DIV(rows, safe)), -QMAX, QMAX)  # (`/` is Div: an index table on CPU)
    return q.reshape((-1,)), scale


def scale_words(scale):
    """The IEEE fp32 bits of each scale (0, or normal and positive) as int32, computed arithmetically."""
    positive = scale > 0
    s = ops.select(positive, scale, ops.ones_like(scale))
    k = ops.clamp(ops.cast(ops.floor(ops.log2(s)), ms.int32), -126, 127)
    p = ops.gather(_POW2, k + 126, 0)
    k = k - ops.cast(s < p, ms.int32) + ops.cast(s >= p * 2, ms.int32)
    p = ops.gather(_POW2, ops.clamp(k, -126, 127) + 126, 0)
    mantissa = ops.cast(ops.round((s / p - 1) * float(_TWO23)), ms.int32)
    words = (k + 127) * _TWO23 + mantissa
    return ops.select(positive, words, ops.zeros_like(words))


def scales_of(words):
    """The fp32 scales of :func:`scale_words`' int32 words (any shape)."""
    exponent = ops.floor_divide(words, _TWO23)
    mantissa = ops.cast(words - exponent * _TWO23, ms.float32)
    p = ops.gather(_POW2, ops.clamp(exponent - 1, 0, 253), 0)  # 2**(exponent - 127)
    value = (mantissa * (1.0 / _TWO23) + 1) * p
    return ops.select(words == 0, ops.zeros_like(value), value)


def encode(x, block: int, nb: int, int8_wire: bool):
    """One rank's payload of the 1-D shard ``x`` as it crosses the collective: the int8 values, then the scales'
    IEEE bytes; as int8 (GPU/Ascend) or as the same bytes in little-endian int32 words (CPU: MindSpore has no
    int8 all-gather there). The words are built directly, the scales' bits being whole words already (the
    values' byte count, ``nb * block``, is a multiple of 4); joined in fp64 and cast once (an integer ``Concat``
    of weight size is avoided: see the module note)."""
    q, scale = quantize(x, block, nb)
    words = scale_words(scale)
    if int8_wire:
        return ops.cast(ops.concat((q, words_to_bytes(words))), ms.int8)
    return ops.cast(ops.concat((_SHARED.word_values(q), ops.cast(words, ms.float64))), ms.int32)


class Decoder(nn.Cell):
    """The receiving side: gathered payloads -> the dequantized rows, with primitive instances of its own, so
    that ``recompute()`` re-runs exactly these in backward (stage 3's re-gather) and nothing else; the payload
    sent (quantized once in forward) is kept. Its methods are inlined where they are called."""

    def __init__(self, block: int, nb: int, shard_size: int, int8_wire: bool):
        super().__init__(auto_prefix=False)
        self.block, self.nb, self.shard_size, self.int8_wire = block, nb, shard_size, int8_wire
        self.bytes = ByteKernels()
        self.cast, self.reshape, self.mul = ops.Cast(), ops.Reshape(), ops.Mul()
        self.slice, self.tile = ops.StridedSlice(), ops.Tile()

    def prims(self):
        return [self.cast, self.reshape, self.mul, self.slice, self.tile, *self.bytes.prims()]

    def receive(self, gathered, rows: int):
        """The gathered tensor of :func:`encode`'s payloads as ``(bytes (rows, L) float32 values, the scales' IEEE
        bits (rows, nb) int32)``. On the int32 wire the scales' bits are the last ``nb`` words of each row, taken
        as they are (a small slice); on the int8 wire they are joined from their bytes."""
        n, nb, block = rows, self.nb, self.block
        if self.int8_wire:
            got = self.reshape(self.cast(gathered, ms.float32), (n, -1))
            return got, self.reshape(self.bytes.bytes_to_words(got[:, nb * block:]), (n, nb))
        words = self.reshape(gathered, (n, -1))
        return self.reshape(self.bytes.words_to_bytes(words), (n, -1)), words[:, nb * block // 4:]

    def decode(self, rows_bytes, scale_bits, dtype):
        """``(R, nb * block + 4 * nb)`` payload bytes (float32 values) and the ``(R, nb)`` scales' bits -> the
        ``(R, shard_size)`` dequantized shards in ``dtype`` (the scales, ``R * nb`` values, are computed with the
        shared kernels: small)."""
        n, nb, block = rows_bytes.shape[0], self.nb, self.block
        q = self.reshape(self.slice(rows_bytes, (0, 0), (n, nb * block), (1, 1)), (n, nb, block))
        scale = scales_of(scale_bits).reshape((n, nb, 1))
        values = self.reshape(self.mul(q, self.tile(scale, (1, 1, block))), (n, nb * block))
        if nb * block != self.shard_size:
            values = self.slice(values, (0, 0), (n, self.shard_size), (1, 1))
        return self.cast(values, dtype)


class QuantizedGather(nn.Cell):
    """Stage 3's quantized gather of one parameter: :meth:`payload` (this rank's shard quantized and packed, once
    per step in forward), then :meth:`rows_of` ``(sent, shard) -> (R, S)``: every kept rank's
    ``dequant(quant(shard))`` in the shard's dtype, whose gradient w.r.t. ``shard`` is the backend's exact
    reduction (``bprop``, the exact gather's own).

    The gradient enters through a :class:`~mindzero.comm.shard_gather.GradientPort`. No Cell is called here: the
    methods are inlined. :meth:`regather` marks the collective and the :class:`Decoder` for
    recompute; the payload is kept from forward, so the shard is quantized once a step."""

    def __init__(self, gather, int8_wire: bool, rows: int, shard_size: int, block: int, select, bprop, attrs):
        super().__init__(auto_prefix=False)
        self.gather, self.int8_wire, self.rows, self.shard_size, self.block = gather, int8_wire, rows, shard_size, block
        self.nb = -(-shard_size // block)
        self.decoder = Decoder(block, self.nb, shard_size, int8_wire)
        self.has_select = select is not None
        kept = rows
        if self.has_select:
            self.select, kept = select, int(select.shape[0])
            self.take = ops.Gather()
        self.kept = kept
        self.port = GradientPort(bprop, kept, {**attrs, "mindzero_quant_block": int(block)})
        self.stop = StopGradient()

    def regather(self):
        prims = [self.gather, self.stop, *self.port.prims(), *self.decoder.prims()]
        prims += [self.take] if self.has_select else []
        for prim in prims:
            if hasattr(prim, "recompute"):  # (the test-only substitute's all-gather is a function)
                prim.recompute()

    def payload(self, shard):
        """This rank's payload of ``shard``, as it crosses the collective (no gradient: :meth:`rows_of` gives the
        shard its gradient through the port)."""
        return ops.stop_gradient(encode(shard, self.block, self.nb, self.int8_wire))

    def rows_of(self, sent, shard):
        got, scale_bits = self.decoder.receive(self.gather(sent), self.rows)
        if self.has_select:
            got, scale_bits = self.take(got, self.select, 0), self.take(scale_bits, self.select, 0)
        # the gradient enters at the port only; a StopGradient of its own, marked for recompute with the rest
        # (``ops.stop_gradient``'s, unmarked, kept the decoded weight alive from forward to backward: no re-gather)
        values = self.stop(self.decoder.decode(got, scale_bits, shard.dtype))
        return self.port.attach(values, shard)

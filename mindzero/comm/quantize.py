"""The graph kernels of a quantized stage-3 gather (the format and its numpy twin: :mod:`mindzero.core.quant`).

MindSpore has no bit-cast operator, so the IEEE bytes of each fp32 scale are computed arithmetically
(exponent from ``log2`` corrected against an exact table of powers of two; mantissa by exact power-of-two
scaling) and the int8 bytes are packed into int32 words by integer arithmetic: the same bytes, bit for bit,
as the numpy twin's ``view``. Every function here is plain graph code, inlined where it is called.
"""
from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops


from ..core.quant import MIN_NORMAL, QMAX

_POW2 = Tensor(np.array([2.0 ** k for k in range(-126, 128)], np.float32))  # exact: 2**k at index k + 126
_BYTE_WEIGHTS = Tensor(np.array([1, 1 << 8, 1 << 16, 1 << 24], np.int32))
_TWO23, _TWO24 = 1 << 23, 1 << 24


def quantize(x, block: int, nb: int):
    """``(q (nb * block,) int32 in [-127, 127], scales (nb,) float32)`` of the 1-D shard ``x`` (computed in fp32)."""
    x = ops.cast(x, ms.float32)
    x = ops.select(ops.abs(x) >= float(MIN_NORMAL), x, ops.zeros_like(x))  # subnormals flushed on every backend
    pad = nb * block - x.shape[0]
    if pad:
        x = ops.concat((x, ops.zeros((pad,), ms.float32)))
    rows = x.reshape((nb, block))
    amax = ops.abs(rows).max(axis=1)
    scale = amax / QMAX
    scale = ops.select(amax > 0, ops.maximum(scale, float(MIN_NORMAL)), ops.zeros_like(scale))
    safe = ops.select(scale > 0, scale, ops.ones_like(scale))
    q = ops.clamp(ops.round(rows / safe.reshape((nb, 1))), -QMAX, QMAX)
    return ops.cast(q, ms.int32).reshape((-1,)), scale


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


def bytes_to_words(b):
    """Signed bytes (int32 values in [-128, 127], length a multiple of 4) -> little-endian int32 words."""
    b = b.reshape((-1, 4))
    unsigned = ops.concat((ops.floor_mod(b[:, :3], 256), b[:, 3:]), 1)  # the top byte keeps its sign
    return ops.cast((unsigned * _BYTE_WEIGHTS).sum(axis=1), ms.int32)  # (sum promotes int32 to int64)


def words_to_bytes(w):
    """Little-endian int32 words -> their signed bytes (int32 values in [-128, 127]), 4 per word."""
    top = ops.floor_divide(w, _TWO24)
    rest = w - top * _TWO24
    low = ops.stack((ops.floor_mod(rest, 256), ops.floor_mod(ops.floor_divide(rest, 256), 256),
                     ops.floor_divide(rest, 1 << 16)), 1)
    low = low - ops.cast(low >= 128, ms.int32) * 256
    return ops.concat((low, top.reshape((-1, 1))), 1).reshape((-1,))


def encode(x, block: int, nb: int):
    """One rank's payload as signed bytes (int32 values): the int8 values, then the scales' IEEE bytes."""
    q, scale = quantize(x, block, nb)
    return ops.concat((q, words_to_bytes(scale_words(scale))))


def send(payload, int8_wire: bool):
    """A payload as it crosses the collective: int8 (GPU/Ascend) or int32 words (CPU: MindSpore 2.10 has no int8
    all-gather there; the same bytes)."""
    if int8_wire:
        return ops.cast(payload, ms.int8)
    return bytes_to_words(payload)


class Decoder(nn.Cell):
    """The receiving side: gathered payloads -> the dequantized rows, with primitive instances of its own, so
    that ``recompute()`` re-runs exactly these in backward (stage 3's re-gather) and nothing else; the payload
    sent (quantized once in forward) is kept. Its methods are inlined where they are called."""

    def __init__(self, block: int, nb: int, shard_size: int, int8_wire: bool):
        super().__init__(auto_prefix=False)
        self.block, self.nb, self.shard_size, self.int8_wire = block, nb, shard_size, int8_wire
        self.cast, self.reshape, self.mul, self.sub = ops.Cast(), ops.Reshape(), ops.Mul(), ops.Sub()
        self.floordiv, self.floormod, self.ge = ops.FloorDiv(), ops.FloorMod(), ops.GreaterEqual()
        self.stack, self.concat, self.slice = ops.Stack(1), ops.Concat(1), ops.StridedSlice()

    def prims(self):
        return [self.cast, self.reshape, self.mul, self.sub, self.floordiv, self.floormod, self.ge, self.stack,
                self.concat, self.slice]

    def words_to_bytes(self, w):
        """:func:`words_to_bytes` with this decoder's primitives."""
        top = self.floordiv(w, _TWO24)
        rest = self.sub(w, self.mul(top, _TWO24))
        low = self.stack((self.floormod(rest, 256), self.floormod(self.floordiv(rest, 256), 256),
                          self.floordiv(rest, 1 << 16)))
        low = self.sub(low, self.mul(self.cast(self.ge(low, 128), ms.int32), 256))
        return self.reshape(self.concat((low, self.reshape(top, (-1, 1)))), (-1,))

    def receive(self, gathered, rows: int):
        """The gathered tensor of :func:`send`'s payloads as ``(rows, L)`` bytes (int32 values)."""
        if self.int8_wire:
            return self.reshape(self.cast(gathered, ms.int32), (rows, -1))
        return self.reshape(self.words_to_bytes(gathered), (rows, -1))

    def decode(self, rows_bytes, dtype):
        """``(R, nb * block + 4 * nb)`` payload bytes (int32 values) -> the ``(R, shard_size)`` dequantized shards
        in ``dtype`` (the scales, ``R * nb`` values, are computed with the shared kernels: small)."""
        n, nb, block = rows_bytes.shape[0], self.nb, self.block
        q = self.slice(rows_bytes, (0, 0), (n, nb * block), (1, 1))
        q = self.reshape(self.cast(q, ms.float32), (n, nb, block))
        scale = scales_of(bytes_to_words(rows_bytes[:, nb * block:]).reshape((n, nb, 1)))
        values = self.reshape(self.mul(q, scale), (n, nb * block))
        if nb * block != self.shard_size:
            values = self.slice(values, (0, 0), (n, self.shard_size), (1, 1))
        return self.cast(values, dtype)


def _into_first_row(reduce_into_shard, rows: int):
    """The gradient transform of a quantized gather's port: the incoming ``(R, S)`` gradient reduced into this
    rank's shard (``reduce_into_shard``, the exact gather's backward), placed in row 0 of zeros, so that the sum
    over rows ``Tile``'s own gradient takes is exactly that reduction (``x + 0 = x``)."""

    def transform(dout):
        grad = reduce_into_shard(dout[0], None, dout.reshape((-1,)))[0]
        grad = ops.cast(grad, dout.dtype).reshape((1, -1))
        if rows == 1:
            return grad
        return ops.concat((grad, ops.zeros((rows - 1, grad.shape[1]), grad.dtype)))

    return transform


class QuantizedGather(nn.Cell):
    """Stage 3's quantized gather of one parameter: :meth:`payload` (this rank's shard quantized and packed, once
    per step in forward), then :meth:`rows_of` ``(sent, shard) -> (R, S)``: every kept rank's
    ``dequant(quant(shard))`` in the shard's dtype, whose gradient w.r.t. ``shard`` is the backend's exact
    reduction (``bprop``, the exact gather's own).

    The gradient enters through a port: the shard tiled to ``(R, S)`` under ``InsertGradientOf`` (which hands
    ``Tile``'s gradient the exact reduction in row 0), added as ``rows + (port + stop_gradient(-port))``: exactly
    ``rows`` (``x + (-x) = 0``). MindSpore has no primitive that returns one input and takes another's gradient;
    measured dead ends: ``Depend``/``MulNoNan`` subclasses with a registered gradient (built in C++, not looked
    up by class: lost), ``EmbeddingLookup`` (the gradient turns sparse), ``Expand`` (refuses outputs above 10**6
    elements), a Cell with ``bprop`` per read site (a 105M GPT at 4 ranks ran out of 24 GiB compiling). No Cell
    is called here: the methods are inlined. :meth:`regather` marks the collective and the :class:`Decoder` for
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
        self.tile, self.kept = ops.Tile(), kept
        self.port = ops.InsertGradientOf(_into_first_row(bprop, kept))
        for key, value in attrs.items():  # MindSpore caches a primitive's gradient by name and attributes
            self.port.add_prim_attr(key, value)
        self.port.add_prim_attr("mindzero_quant_block", int(block))
        self.add, self.neg = ops.Add(), ops.Neg()

    def regather(self):
        prims = [self.gather, self.add, self.neg, self.tile, *self.decoder.prims()]
        prims += [self.take] if self.has_select else []
        for prim in prims:
            if hasattr(prim, "recompute"):  # (the test-only substitute's all-gather is a function)
                prim.recompute()

    def payload(self, shard):
        """This rank's payload of ``shard``, as it crosses the collective (no gradient: :meth:`rows_of` gives the
        shard its gradient through the port)."""
        return ops.stop_gradient(send(encode(shard, self.block, self.nb), self.int8_wire))

    def rows_of(self, sent, shard):
        got = self.decoder.receive(self.gather(sent), self.rows)
        if self.has_select:
            got = self.take(got, self.select, 0)
        values = self.decoder.decode(got, shard.dtype)
        port = self.port(self.tile(shard.reshape((1, -1)), (self.kept, 1)))
        return self.add(values, self.add(port, ops.stop_gradient(self.neg(port))))

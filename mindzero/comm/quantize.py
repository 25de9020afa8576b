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


def decode(rows_bytes, block: int, nb: int, shard_size: int, dtype):
    """``(R, nb * block + 4 * nb)`` payload bytes (int32 values) -> the ``(R * shard_size,)`` dequantized
    shards in ``dtype``."""
    n = rows_bytes.shape[0]
    q = ops.cast(rows_bytes[:, :nb * block], ms.float32).reshape((n, nb, block))
    scale = scales_of(bytes_to_words(rows_bytes[:, nb * block:]).reshape((n, nb, 1)))
    values = (q * scale).reshape((n, nb * block))
    if nb * block != shard_size:
        values = values[:, :shard_size]
    return ops.cast(values.reshape((-1,)), dtype)


def send(payload, int8_wire: bool):
    """A payload as it crosses the collective: int8 (GPU/Ascend) or int32 words (CPU: MindSpore 2.10 has no int8
    all-gather there; the same bytes)."""
    if int8_wire:
        return ops.cast(payload, ms.int8)
    return bytes_to_words(payload)


def receive(gathered, rows: int, int8_wire: bool):
    """The gathered tensor of :func:`send`'s payloads as ``(rows, L)`` bytes (int32 values)."""
    if int8_wire:
        return ops.cast(gathered, ms.int32).reshape((rows, -1))
    return words_to_bytes(gathered).reshape((rows, -1))


class QuantizedGather(nn.Cell):
    """Stage 3's quantized gather of one parameter: ``(sent, shard) -> (rows * S,)`` in the shard's dtype, where
    ``sent`` is this rank's payload (:func:`encode` then :func:`send`, made by the caller once per step) and the
    result every kept rank's ``dequant(quant(shard))``, padded; the gradient w.r.t. ``shard`` is ``bprop``, the
    backend's exact reduction of the incoming gradient into this rank's shard (the exact gather's own), and
    ``sent`` has none.

    A Cell with ``bprop``: MindSpore has no primitive that returns one input and takes another's gradient (a
    ``Depend`` subclass with a registered gradient loses it: measured). ``recompute()`` on it re-runs the
    collective and the decode in backward from the payload kept since forward: the shard is quantized once.
    """

    def __init__(self, gather, int8_wire: bool, rows: int, shard_size: int, block: int, select, bprop):
        super().__init__(auto_prefix=False)
        self.gather, self.int8_wire, self.rows, self.shard_size, self.block = gather, int8_wire, rows, shard_size, block
        self.nb = -(-shard_size // block)
        self.has_select = select is not None
        if self.has_select:
            self.select, self.kept = select, int(select.shape[0])
        self.zero_bprop = bprop

    def payload(self, shard):
        """This rank's payload of ``shard``, as it crosses the collective."""
        return send(encode(shard, self.block, self.nb), self.int8_wire)

    def construct(self, sent, shard):
        got = receive(self.gather(sent), self.rows, self.int8_wire)
        if self.has_select:
            got = ops.gather(got, self.select, 0)
        return decode(got, self.block, self.nb, self.shard_size, shard.dtype)

    def bprop(self, sent, shard, out, dout):
        return ops.zeros_like(sent), self.zero_bprop(shard, out, dout)[0]

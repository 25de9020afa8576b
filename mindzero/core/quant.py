"""Quantized stage-3 weight gathers (ZeRO++'s qwZ): the policy, the wire format and its numpy twin. Pure: no
MindSpore import (the graph kernels are :mod:`mindzero.comm.quantize`; tests hold the two equal bit for bit).

What a rank sends for one parameter's gather, instead of its fp32 (or ``param_dtype``) shard of ``S`` elements:
the shard cut into ``nb = ceil(S / B)`` blocks of ``B`` elements (the last one zero-padded), each block as
``B`` symmetric int8 values ``q = round(x / scale)`` with one fp32 ``scale = max|block| / 127`` per block::

    payload bytes = [q of block 0 .. nb-1 (nb * B int8)] + [scale of block 0 .. nb-1 (nb * 4 bytes, IEEE fp32,
                    little-endian)]

one byte stream, so the scales travel in the same collective as the values. GPU/Ascend all-gather it as int8;
where a backend has no int8 all-gather (MindSpore's CPU collectives), the same bytes travel as int32
words (4 bytes each, little-endian: ``payload.view(int32)``). Receivers decode every rank's payload and
dequantize to ``q * scale`` (fp32), then the reader's dtype.

Error bound (per element, fp32 arithmetic): ``|dequant(quant(x)) - x| <= max|block| / 254`` (half a
quantization step), except near fp32's smallest normal number: elements below ``2**-126`` in magnitude (fp32
subnormals, which MindSpore's CPU kernels treat as zero) are sent as 0, and blocks whose ``max|block| / 127``
is below ``2**-126`` get that scale, so their error is at most ``2**-126``. An all-zero block is exact.
What a rank stores (its shard, masters, optimizer states, EMA, checkpoints) is never quantized: only the
gathered copy a forward or backward reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Optional

import numpy as np

from .checks import is_int

QUANT_KINDS = ("int8",)
QMAX = 127  # symmetric int8: [-127, 127] (-128 unused, so the grid is symmetric)
MIN_NORMAL = np.float32(2.0 ** -126)
BLOCK_RANGE = (16, 1 << 20)
#: parameters kept exact by default: the 1-D ones (biases, norm scales and shifts: small and sensitive)
DEFAULT_MIN_NUMEL = 1 << 16
DEFAULT_EXCLUDE = ("*bias*", "*norm*", "*beta*", "*gamma*")


@dataclass(frozen=True)
class GatherQuantization:
    """``gather_quantization`` of :func:`mindzero.prepare_train_network`: stage 3's weight gathers send int8
    with one fp32 scale per block of ``block_size`` elements. A parameter stays exact when it has fewer than
    ``min_numel`` elements, is 1-D, or its name matches a pattern of ``exclude`` (``fnmatch``, case-sensitive:
    ``"*norm*"`` keeps LayerNorm/BatchNorm weights exact)."""

    kind: str = "int8"
    block_size: int = 256
    min_numel: int = DEFAULT_MIN_NUMEL
    exclude: tuple = field(default=DEFAULT_EXCLUDE)

    @staticmethod
    def parse(value) -> "Optional[GatherQuantization]":
        """``None`` (off), ``"int8"``, or a mapping with ``kind`` and any of ``block_size``, ``min_numel``,
        ``exclude``.

        Raises:
            ValueError: naming the key, the value and the rule.
        """
        if value is None or isinstance(value, GatherQuantization):
            return value
        if isinstance(value, str):
            value = {"kind": value}
        if not isinstance(value, dict):
            raise ValueError(f"gather_quantization must be None, 'int8' or a mapping such as {{'kind': 'int8', "
                             f"'block_size': 256}}, got {value!r}")
        keys = ("kind", "block_size", "min_numel", "exclude")
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise ValueError(f"gather_quantization: unknown key {unknown[0]!r}; the keys are {list(keys)}")
        kind = value.get("kind", "int8")
        if kind not in QUANT_KINDS:
            raise ValueError(f"gather_quantization['kind'] must be one of {list(QUANT_KINDS)} (symmetric int8 with "
                             f"an fp32 scale per block), got {kind!r}")
        block = value.get("block_size", 256)
        low, high = BLOCK_RANGE
        if not is_int(block) or not low <= block <= high or block % 4:
            raise ValueError(f"gather_quantization['block_size'] must be an int multiple of 4 in [{low}, {high}] "
                             f"(elements per fp32 scale), got {block!r}")
        min_numel = value.get("min_numel", DEFAULT_MIN_NUMEL)
        if not is_int(min_numel) or min_numel < 0:
            raise ValueError(f"gather_quantization['min_numel'] must be an int >= 0 (smaller parameters are "
                             f"gathered exactly), got {min_numel!r}")
        exclude = value.get("exclude", DEFAULT_EXCLUDE)
        if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude):
            raise ValueError(f"gather_quantization['exclude'] must be a list of name patterns (fnmatch), "
                             f"got {exclude!r}")
        return GatherQuantization(kind, int(block), int(min_numel), tuple(exclude))

    def applies(self, name: str, shape) -> bool:
        """Whether the parameter ``name`` of ``shape`` is gathered quantized."""
        numel = int(np.prod(shape)) if len(shape) else 1
        return (len(shape) >= 2 and numel >= self.min_numel
                and not any(fnmatchcase(name, pattern) for pattern in self.exclude))

    def as_dict(self) -> dict:
        return {"kind": self.kind, "block_size": self.block_size, "min_numel": self.min_numel,
                "exclude": list(self.exclude)}


def block_for(quantization, name: str, shape):
    """The block size ``name`` (of ``shape``) is gathered with under ``quantization`` (a :class:`GatherQuantization`,
    or ``None``: no quantized gathers), or ``None`` where it is gathered as held."""
    return quantization.block_size if quantization is not None and quantization.applies(name, shape) else None


def blocks(shard_size: int, block: int) -> int:
    """Blocks of one rank's shard."""
    return -(-int(shard_size) // int(block))


def payload_bytes(shard_size: int, block: int) -> int:
    """Bytes one rank sends for one quantized gather: the int8 values (the last block padded) and the scales."""
    nb = blocks(shard_size, block)
    return nb * block + 4 * nb


# --- the numpy twin of the graph kernels (mindzero.comm.quantize) -------------------------------------------
def quantize(x, block: int):
    """``(q (nb * block,) int8, scales (nb,) float32)`` of a 1-D shard (any float dtype: computed in fp32)."""
    x = np.asarray(x).astype(np.float32).reshape(-1)
    x = np.where(np.abs(x) >= MIN_NORMAL, x, np.float32(0))  # fp32 subnormals flushed (MindSpore's CPU kernels do)
    nb = blocks(x.size, block)
    padded = np.zeros(nb * block, np.float32)
    padded[:x.size] = x
    rows = padded.reshape(nb, block)
    amax = np.abs(rows).max(axis=1)
    scale = amax / np.float32(QMAX)
    scale = np.where(amax > 0, np.maximum(scale, MIN_NORMAL), np.float32(0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(rows / safe[:, None]), -QMAX, QMAX).astype(np.int8)
    return q.reshape(-1), scale


def dequantize(q, scales, size: int, dtype=np.float32):
    """The first ``size`` values of ``q * scale`` (fp32 arithmetic), as ``dtype``."""
    nb = scales.size
    rows = q.reshape(nb, -1).astype(np.float32) * scales.astype(np.float32)[:, None]
    return rows.reshape(-1)[:size].astype(dtype)


def payload(x, block: int) -> np.ndarray:
    """The bytes a rank sends (int8): the int8 values, then each scale's 4 IEEE bytes."""
    q, scales = quantize(x, block)
    return np.concatenate([q, scales.astype("<f4").view(np.int8)])


def decode(payload_bytes_, shard_size: int, block: int, dtype=np.float32):
    """The dequantized shard of one rank's payload (int8 bytes, or the same as int32 words)."""
    raw = np.asarray(payload_bytes_)
    raw = raw.view(np.int8) if raw.dtype != np.int8 else raw
    nb = blocks(shard_size, block)
    q, scales = raw[:nb * block], raw[nb * block:].copy().view("<f4")
    return dequantize(q, scales, shard_size, dtype)


def gathered(shards, block: int, dtype=np.float32):
    """What a quantized gather returns on every rank: the ranks' decoded shards, concatenated (padded)."""
    return np.concatenate([decode(payload(s, block), np.asarray(s).size, block, dtype) for s in shards])

"""The one checksum of mindzero (pure): CRC-32 of checkpoint pieces, JSON files and the marker
(:mod:`mindzero.checkpoint`), and of the initial values compared across ranks (:mod:`mindzero.engine.consistency`)."""
from __future__ import annotations

import zlib

import numpy as np


def crc32_bytes(data) -> int:
    """CRC-32 of a bytes-like object (zlib's, as in zip and PNG): the one checksum of mindzero's checkpoints
    (pieces, JSON files, the marker) and of the cross-rank initial-value check."""
    return zlib.crc32(data) & 0xFFFFFFFF


def crc32_array(array: np.ndarray) -> int:
    """CRC-32 of an array's raw bytes in C order (what a writer stores for it)."""
    return crc32_bytes(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))

"""Every reader of a mindzero checkpoint goes through :class:`Source` (no MindSpore import): the live
:func:`mindzero.load_checkpoint`, the offline merge, reshard and verify.

Validation before anything is read: the ``COMPLETE`` marker's checksum and every file it lists (size, JSON
checksums), every rank's split info present and agreeing; every piece read is verified against its CRC-32.
:meth:`Source.piece_for` is the one rule for what a rank of another layout stores for a tensor.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from ..core.plan import shard_of_flat
from .format import SplitInfoError, TensorEntry, read_all, read_marker
from ..core.checksum import crc32_array
from .tensor_io import CheckpointFileError, np_dtype, open_reader


class MergeError(ValueError):
    """The checkpoint cannot be merged or resharded; nothing was written."""


class Source:
    """A validated checkpoint directory: its marker, its ranks' split infos and a reader per file.

    Validation before anything is read: the ``COMPLETE`` marker's checksum and every file it lists (size,
    JSON checksums), every rank's split info present and agreeing. With ``check_pieces`` (merge, reshard,
    verify) every piece's dtype and shape are checked up front; :func:`mindzero.load_checkpoint` checks only
    the pieces it reads. Every piece read is verified against its CRC-32 (``format_version`` 2).
    """

    def __init__(self, ckpt_dir, check_pieces=True, error=None):
        self.error = error or MergeError
        self.dir = Path(ckpt_dir)
        if not self.dir.is_dir():
            raise self.error(f"{self.dir}: checkpoint directory does not exist")
        try:
            self.marker = read_marker(self.dir)
            self.infos = read_all(self.dir)
        except SplitInfoError as err:
            raise self.error(str(err)) from None
        self.ref = self.infos[0]
        self.op_size = self.ref.op_size
        self.verified = self.marker["verified"] and self.ref.format_version >= 2
        if not self.verified:
            warnings.warn(f"{self.dir}: a checkpoint without checksums (format_version {self.ref.format_version}); "
                          "read without verification", stacklevel=2)
        self.crcs = {}  # (file, key) -> CRC-32 recorded by the rank that wrote the piece
        for info in self.infos:
            for t in info.tensors:
                if t.crc32 is not None:
                    self.crcs[(t.file, t.key)] = t.crc32
        self.readers = {}
        self._by_name = [info.by_name() for info in self.infos]
        if check_pieces:
            for info in self.infos:
                for t in info.tensors:
                    self.check_piece(t)

    def _reader(self, file):
        if file not in self.readers:
            try:
                self.readers[file] = open_reader(self.dir / file)
            except CheckpointFileError as err:
                raise self.error(str(err)) from None
        return self.readers[file]

    def check_piece(self, t: TensorEntry) -> None:
        try:
            dtype, shape = self._reader(t.file).meta(t.key)
        except CheckpointFileError as err:
            raise self.error(str(err)) from None
        want = (t.shard_size,) if t.sharded else tuple(t.shape)
        if dtype != t.dtype or tuple(shape) != want:
            raise self.error(f"{self.dir / t.file}: tensor {t.key!r} is {dtype}{tuple(shape)}, the split info "
                             f"says {t.dtype}{want}")
        if self.verified and (t.file, t.key) not in self.crcs:
            raise self.error(f"{self.dir}: no rank's split info records a checksum for tensor {t.key!r} of "
                             f"{t.file}")

    def read_piece(self, t: TensorEntry) -> np.ndarray:
        """One stored piece, as written (a shard with its padding, or a whole tensor), checksum verified."""
        self.check_piece(t)
        try:
            value = self._reader(t.file).read(t.key)
        except CheckpointFileError as err:
            raise self.error(str(err)) from None
        want = self.crcs.get((t.file, t.key))
        if self.verified:
            got = crc32_array(value)
            if got != want:
                raise self.error(f"{self.dir / t.file}: tensor {t.key!r} fails its checksum: CRC-32 {got}, the "
                                 f"split info recorded {want} (the file was altered or damaged)")
        return value

    def entry(self, name: str, op_rank: int = 0) -> TensorEntry:
        if name not in self._by_name[op_rank]:
            raise self.error(f"{self.dir}: has no tensor {name!r}")
        return self._by_name[op_rank][name]

    def has(self, name: str) -> bool:
        return name in self._by_name[0]

    def window(self, name: str, start: int, count: int) -> np.ndarray:
        """Elements ``[start, start + count)`` of the flattened full tensor ``name``, reading only the stored
        pieces that overlap them (each whole, to verify it): about one tensor of memory at most."""
        first = self.entry(name)
        out = np.empty(count, dtype=np_dtype(first.dtype))
        if not first.sharded:
            out[:] = self.read_piece(first).reshape(-1)[start:start + count]
            return out
        for by_name in self._by_name:
            t = by_name[name]
            lo, hi = max(start, t.offset), min(start + count, t.offset + t.valid)
            if lo < hi:
                out[lo - start:hi - start] = self.read_piece(t)[lo - t.offset:hi - t.offset]
        return out

    def full(self, name: str) -> np.ndarray:
        """The full tensor ``name``: rank 0's copy, or the shards of every rank joined and unpadded."""
        first = self.entry(name)
        return self.window(name, 0, first.numel).reshape(first.shape)

    def rank_piece(self, name: str, op_rank: int) -> np.ndarray:
        """Op rank ``op_rank``'s own copy of a tensor stored per rank (e.g. BatchNorm statistics)."""
        t = self.entry(name, op_rank)
        return self.read_piece(t).reshape(t.shape)

    def piece_for(self, target: TensorEntry, op_rank: int, full=None) -> np.ndarray:
        """What op rank ``op_rank`` of another layout stores for ``target`` (an entry of that layout): the one rule
        behind both :func:`reshard_checkpoint` and loading at another world size or stage
        (:func:`mindzero.load_checkpoint`). The same layout reads the stored piece as it is; a shard is
        cut from the full tensor and zero-padded; a per-rank buffer (e.g. BatchNorm statistics) comes from
        old op rank ``op_rank``, or op rank 0 when the old run had fewer ranks. ``full``: the full tensor if the caller
        already holds it."""
        if op_rank < self.op_size:
            old = self.entry(target.name, op_rank)
            if ((old.sharded, old.offset, old.shard_size) == (target.sharded, target.offset, target.shard_size)
                    and old.file.startswith("rank_") == target.file.startswith("rank_")):
                return self.read_piece(old).reshape((old.shard_size,) if old.sharded else old.shape)
        if target.per_rank:
            return self.rank_piece(target.name, op_rank if op_rank < self.op_size else 0)
        if not target.sharded:
            return full if full is not None else self.full(target.name)
        if full is not None:
            return shard_of_flat(full.reshape(-1), target)
        piece = np.zeros(target.shard_size, dtype=np_dtype(target.dtype))
        piece[:target.valid] = self.window(target.name, target.offset, target.valid)
        return piece

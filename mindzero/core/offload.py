"""Optimizer states on disk (pure Python and numpy): the policy, the layout of one rank's state file, the space
check and the file itself.

``optimizer_offload="disk"`` keeps each rank's optimizer states (Adam's two moments, SGD's momentum, ...) in one
file under ``offload_dir`` instead of memory. The update streams them through memory one *piece* at a time: a
piece is a run of one optimizer parameter's elements (its shard from stage 1 on), the whole parameter when its
states fit in ``offload_chunk_mb``, else slices of it that do. A piece's states lie side by side in the file
(``[state 0 of the piece][state 1 of the piece]...``), pieces in update order, so one piece is one read and one
write.

Page cache: the file is read and written with ``pread``/``pwrite`` and the kernel is told to drop what was
touched (``posix_fadvise(POSIX_FADV_DONTNEED)``: after each read at once, after writes once they are on disk,
``fdatasync``), so the states do not come back as cached memory. ``O_DIRECT`` would avoid the cache without
the sync, but needs 4 KiB-aligned buffers, offsets and lengths, and tmpfs and some overlay filesystems refuse
it; the same code then works on every filesystem. Space is reserved when the file is made
(``posix_fallocate``), so a full disk fails before the first step, not in the middle of one.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .checks import is_number

#: what ``optimizer_offload`` accepts: ``False``, ``True`` (= ``"host"``, mindone's), ``"host"``, ``"disk"``
OFFLOAD_TIERS = ("host", "disk")
DEFAULT_CHUNK_MB = 2
#: pieces of a parameter start at multiples of this many elements (page-sized reads and writes)
PIECE_ALIGN = 4096
#: every state of a piece starts at a multiple of this many bytes, in the file and in memory: vectorised update
#: kernels take another code path on unaligned memory (nn.Adam's fused kernel on a state at an unaligned offset
#: changes last bits; aligned, it is bit-identical)
ALIGN_BYTES = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN_BYTES`."""
    return -(-int(nbytes) // ALIGN_BYTES) * ALIGN_BYTES


def record_bytes(numel: int, itemsizes) -> int:
    """Bytes of one piece's record: each state of ``numel`` elements, aligned."""
    return sum(aligned(numel * size) for size in itemsizes)


class OffloadError(OSError):
    """The offload directory cannot hold the states (missing, not writable, not enough space), or its file failed."""


#: The optimizers whose parameters disk offload cuts into pieces, by class (qualified name), with the names
#: ``estimate_memory`` knows them by (:data:`mindzero.core.optim_plan.OPTIMIZER_MODELS`): one table for the
#: offload (:func:`mindzero.engine.offload.splits_parameters`) and the estimates.
#: Bit-identical in pieces (tests/single/test_offload.py). Not nn.Adam: its fused ApplyAdam kernel splits a tensor
#: between threads and computes each thread's last elements with scalar code, the rest 8 lanes at a time with FMA,
#: so an element at a thread boundary of the whole tensor gets another last bit in a piece. Every other optimizer
#: is streamed a whole parameter at a time.
SPLITTABLE_OPTIMIZERS = {
    "mindspore.nn.optim.adam.AdamWeightDecay": ("adamw",),
    "mindspore.nn.optim.sgd.SGD": ("sgd",),
    "mindspore.nn.optim.momentum.Momentum": ("momentum",),
    "mindspore.mint.optim.adam.Adam": ("mint.adam", "mint.adam_amsgrad"),
    "mindspore.mint.optim.sgd.SGD": ("mint.sgd",),
}
SPLITTABLE_MODELS = frozenset(name for names in SPLITTABLE_OPTIMIZERS.values() for name in names)

@dataclass(frozen=True)
class OffloadPolicy:
    """Where the optimizer states live: ``tier`` ``None`` (memory), ``"host"`` (the update primitive on the host:
    GPU/Ascend) or ``"disk"`` (files under ``dir``, streamed in pieces of at most ``chunk_mb`` MiB of states;
    ``keep``: leave the files at exit)."""

    tier: str = None
    dir: str = None
    chunk_mb: float = DEFAULT_CHUNK_MB
    keep: bool = False

    @staticmethod
    def tier_of(optimizer_offload):
        """The tier ``optimizer_offload`` names: ``None``, ``"host"`` or ``"disk"``.

        Raises:
            ValueError: naming the option, the value and the rule.
        """
        if optimizer_offload is False or optimizer_offload is None:
            return None
        if optimizer_offload is True:
            return "host"
        if isinstance(optimizer_offload, str) and optimizer_offload in OFFLOAD_TIERS:
            return optimizer_offload
        raise ValueError(f"optimizer_offload must be a bool, 'host' or 'disk', got {optimizer_offload!r}")

    @staticmethod
    def parse(optimizer_offload, offload_dir=None, chunk_mb=DEFAULT_CHUNK_MB, keep=False) -> "OffloadPolicy":
        """The policy of ``prepare_train_network``'s four offload options.

        Raises:
            ValueError: naming the option, the value and the rule.
        """
        tier = OffloadPolicy.tier_of(optimizer_offload)
        if tier == "disk":
            if offload_dir is None or not isinstance(offload_dir, (str, os.PathLike)) or str(offload_dir) == "":
                raise ValueError(f"offload_dir must be a directory path when optimizer_offload='disk', got "
                                 f"{offload_dir!r}")
        elif offload_dir is not None:
            raise ValueError(f"offload_dir={offload_dir!r} is given but optimizer_offload={optimizer_offload!r}; it "
                             "is used only with optimizer_offload='disk'")
        if not is_number(chunk_mb) or not chunk_mb > 0:
            raise ValueError(f"offload_chunk_mb must be a number > 0 (MiB of optimizer states per piece), got "
                             f"{chunk_mb!r}")
        if not isinstance(keep, bool):
            raise ValueError(f"offload_keep must be a bool, got {keep!r}")
        return OffloadPolicy(tier, None if offload_dir is None else str(offload_dir), chunk_mb, keep)

    @property
    def disk(self) -> bool:
        return self.tier == "disk"

    @property
    def chunk_bytes(self) -> int:
        """``chunk_mb`` in bytes: the most state bytes of a piece."""
        return int(self.chunk_mb * 2 ** 20)

    def check_stage(self, zero_stage: int) -> None:
        """The disk tier streams each rank's shard of the states: it needs a stage that shards them.

        Raises:
            ValueError: ``"disk"`` at stage 0.
        """
        if self.disk and zero_stage == 0:
            raise ValueError("optimizer_offload='disk' needs zero_stage 1, 2 or 3 (each rank streams its shard of the "
                             "optimizer states from disk); got zero_stage=0")

    @property
    def host(self) -> bool:
        return self.tier == "host"


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened optimizer parameter ``index``, and where its states are in the
    file (``offset``; state ``k`` at ``offset + start_of[k]``)."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StateLayout:
    """One rank's state file: the pieces in update order, the bytes per element of each state, the file size."""

    pieces: tuple
    itemsizes: tuple
    chunk_elems: int

    @staticmethod
    def build(numels, itemsizes, chunk_bytes: int, split: bool = True) -> "StateLayout":
        """Cut parameters of ``numels`` elements (optimizer order) into pieces whose states (``itemsizes``: bytes
        per element of each state) take at most ``chunk_bytes``, rounded down to a multiple of
        :data:`PIECE_ALIGN` elements (at least that many); ``split=False``: one piece per parameter, whatever its
        size (an optimizer whose update kernel computes an element differently by its position in the tensor)."""
        per_elem = sum(itemsizes)
        chunk = max(PIECE_ALIGN, int(chunk_bytes) // max(per_elem, 1) // PIECE_ALIGN * PIECE_ALIGN)
        if not split:
            chunk = max([PIECE_ALIGN, *(int(n) for n in numels)])
        pieces, offset = [], 0
        for i, numel in enumerate(numels):
            for start in range(0, max(int(numel), 1), chunk):
                stop = min(start + chunk, int(numel))
                if stop <= start:
                    continue
                pieces.append(Piece(i, start, stop, offset))
                offset += record_bytes(stop - start, itemsizes)
        return StateLayout(tuple(pieces), tuple(int(s) for s in itemsizes), chunk)

    @property
    def nbytes(self) -> int:
        """The file's size: every piece's record."""
        return sum(self.record_bytes(p) for p in self.pieces)

    @property
    def piece_bytes(self) -> int:
        """The largest piece's record: its states, each aligned (one slot's states)."""
        return max((self.record_bytes(p) for p in self.pieces), default=0)

    def record_bytes(self, piece: Piece) -> int:
        return record_bytes(piece.numel, self.itemsizes)

    def state_offsets(self, piece: Piece) -> tuple:
        """Byte offset of each state of ``piece`` within its record (each at a multiple of :data:`ALIGN_BYTES`)."""
        out, at = [], 0
        for size in self.itemsizes:
            out.append(at)
            at += aligned(piece.numel * size)
        return tuple(out)

    def pieces_of(self, index: int) -> list:
        return [p for p in self.pieces if p.index == index]


SLOTS = 3  # read-ahead, in update, write-behind


def gradient_at(layout: StateLayout, param_itemsizes) -> int:
    """Where a slot's gradient values start: after the largest piece's parameter values (``param_itemsizes``: bytes
    per element of each optimizer parameter; a gradient has its parameter's dtype), rounded up to 64 bytes."""
    return aligned(max((p.numel * param_itemsizes[p.index] for p in layout.pieces), default=0))


def states_at(layout: StateLayout, param_itemsizes) -> int:
    """Where a slot's states start: after the largest piece's parameter values and its gradient values."""
    return 2 * gradient_at(layout, param_itemsizes)


def slot_bytes(layout: StateLayout, param_itemsizes) -> int:
    """Bytes of the stream's slots: :data:`SLOTS` x (a piece's parameter values, its gradient and its states)."""
    return SLOTS * (states_at(layout, param_itemsizes) + layout.piece_bytes)


def check_directory(path, need_bytes: int) -> Path:
    """``path`` exists, is a writable directory and has ``need_bytes`` free.

    Raises:
        OffloadError: naming the directory, the bytes needed and what is wrong.
    """
    path = Path(path)
    need = f"{need_bytes} bytes ({need_bytes / 2 ** 20:.1f} MiB) of optimizer states for this rank"
    if not path.exists():
        raise OffloadError(f"offload_dir {str(path)!r} does not exist; create it (it must hold {need})")
    if not path.is_dir():
        raise OffloadError(f"offload_dir {str(path)!r} is not a directory; it must be one that holds {need}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(f"offload_dir {str(path)!r} is not writable by this process; it must hold {need}")
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OffloadError(f"offload_dir {str(path)!r} has {free} bytes ({free / 2 ** 20:.1f} MiB) free, needs {need}")
    return path


class StateFile:
    """One rank's state file: made at its full size (space reserved), read and written piece by piece with the
    page cache dropped behind (module docstring); removed by :meth:`close` unless ``keep``."""

    def __init__(self, path, nbytes: int, keep: bool = False, flush_bytes: int = 64 << 20):
        self.path, self.nbytes, self.keep, self.flush_bytes = Path(path), int(nbytes), keep, int(flush_bytes)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.dirty = 0
        self.read_bytes = self.written_bytes = 0
        try:
            if self.nbytes:
                os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as err:
            self.close()
            raise OffloadError(f"offload_dir {str(self.path.parent)!r}: cannot reserve {self.nbytes} bytes "
                               f"({self.nbytes / 2 ** 20:.1f} MiB) for this rank's optimizer states: {err}") from None

    def read(self, buf, offset: int) -> None:
        """Fill ``buf`` (a writable, contiguous buffer) from ``offset``; its pages leave the cache."""
        view = memoryview(buf).cast("B")
        got = os.preadv(self.fd, [view], offset)
        if got != len(view):
            raise OffloadError(f"{self.path}: short read at {offset} ({got} of {len(view)} bytes)")
        os.posix_fadvise(self.fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        self.read_bytes += got

    def write(self, buf, offset: int) -> None:
        """Write ``buf`` at ``offset``; every ``flush_bytes`` written, :meth:`flush`."""
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        self.written_bytes += done
        self.dirty += done
        if self.dirty >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Make what was written durable and drop it from the page cache."""
        if self.dirty:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self.dirty = 0

    def close(self) -> None:
        if self.fd is None:
            return
        os.close(self.fd)
        self.fd = None
        if not self.keep:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

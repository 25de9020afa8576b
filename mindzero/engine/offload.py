"""``optimizer_offload="disk"``: the optimizer states in one file per rank, streamed through the update a piece at a
time (the layout, the file and its page-cache handling: :mod:`mindzero.core.offload`).

How the update stays the optimizer's own: for each piece the optimizer is applied through a *view*
(:func:`mindzero.engine.probe.optimizer_view`): the same class and hyper-parameters over Parameters standing for
the piece. Those Parameters share memory with a slot buffer (on CPU a Parameter's ``asnumpy()`` is its memory, and
``set_data(Tensor.from_numpy(a))`` makes ``a`` its memory): the piece's parameter values and gradient, copied in,
and its states, read into it from the file. So the update writes the values and the states into the slot; the
values are copied back into the parameter and the states written back to the file. A view takes no input (the
gradient is one of its Parameters), so a compiled view keeps no input buffer of its own. Views are compiled
once per distinct (piece shape, per-parameter hyper-parameters, slot) and bound once. Before
each piece the optimizer's shared scalars (step counter, beta powers) are restored to their values before the
step, so each piece sees the step the whole optimizer would; after the last one they hold the advanced values.

Pipelining: three slot buffers; while the view updates piece ``k``, one thread reads piece ``k + 1`` and another
writes piece ``k - 1`` back (file I/O releases the GIL).

The reduced gradients are the step graph's output and live until the update ends, as they do inside the graph
in memory; with gradient accumulation they wait in one buffer per optimizer parameter instead (a graph's branch
cannot return them). Resident beyond that: three slots of at most ``offload_chunk_mb`` of states (and the piece's
parameter values and gradient) each. The states themselves are on disk.
"""
from __future__ import annotations

import itertools
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
import weakref
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from ..core.host import release_host_memory
from ..core.offload import (ALIGN_BYTES, SLOTS, SPLITTABLE_OPTIMIZERS, OffloadError, OffloadPolicy, StateFile,
                            StateLayout, check_directory, gradient_at, states_at)
from ..core.optim_plan import ELEMENT, FLAT, WHOLE
from ..core.plan import dtype_bytes
from .compile_cache import without_process_cache
from .kernels import MAP, store
from .materialize import np_dtype
from .optim import qualified_name
from .probe import optimizer_view, signature
from .states import StateStore, UpdateTail, nbytes

#: optimizers whose update gives each element the same bits whatever piece of the parameter it is computed in, so
#: disk offload may cut their parameters into pieces (at multiples of 4096 elements, memory 64-byte aligned).
def splits_parameters(optimizer) -> bool:
    """Whether disk offload may cut ``optimizer``'s parameters into pieces (:data:`SPLITTABLE_OPTIMIZERS`)."""
    return qualified_name(type(optimizer)) in SPLITTABLE_OPTIMIZERS


def check_offloadable(layout, updates, device: str) -> None:
    """Disk offload streams the states of flat parameters through views of the optimizer.

    Raises:
        ValueError: another device than CPU, an owner-mode parameter, a state not shaped as its parameter, or a
            per-parameter attribute of the optimizer that mindzero does not know (a view cuts it), naming it.
    """
    if device != "CPU":
        raise ValueError(f"optimizer_offload='disk' runs on CPU only (device {device!r}): the streamed update shares "
                         "the parameters' memory with its buffers, which a device's memory is not; on GPU/Ascend use "
                         "optimizer_offload='host' (docs/stages.md)")
    name = type(layout.optimizer).__name__
    for i, update in enumerate(updates):
        if update.mode not in (FLAT, WHOLE):
            raise ValueError(f"optimizer_offload='disk' streams optimizers that update each element from that element "
                             f"alone; {name} updates parameter {layout.params[i].name!r} whole on an owner rank "
                             f"({update.why}): keep its states in memory (optimizer_offload=False)")
        other = [s for s in update.states if s.layout != ELEMENT]
        if other:
            raise ValueError(f"optimizer_offload='disk' streams states shaped as their parameters; {name} keeps "
                             f"{other[0].attr!r} of shape {other[0].shape} for parameter {layout.params[i].name!r}: "
                             "keep its states in memory (optimizer_offload=False)")
    if layout.unknown:
        raise ValueError(f"optimizer_offload='disk' updates each piece through a view of the optimizer, cut to that "
                         f"piece's parameter; {name} keeps per-parameter attributes mindzero does not know "
                         f"({', '.join(layout.unknown)}): keep its states in memory (optimizer_offload=False)")

_SERIAL = itertools.count()  # one file per train step of this process


class DiskState:
    """What a checkpoint sees of one offloaded state (one optimizer parameter's state ``attr``): ``name``,
    ``dtype``, ``shape`` of the in-memory state, ``asnumpy()`` read from the file, ``set_data(tensor)`` written to
    it."""

    def __init__(self, offload, attr, index, name, dtype, shape):
        self.offload, self.attr, self.index = offload, attr, index
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)

    def asnumpy(self) -> np.ndarray:
        return self.offload.read_state(self.attr, self.index).reshape(self.shape)

    def set_data(self, tensor) -> None:
        self.offload.write_state(self.attr, self.index, tensor.asnumpy())


class OffloadFile:
    """The states' file of one train step, made before any state exists (directory checked, space reserved):
    :meth:`keep` is handed to :func:`mindzero.engine.repoint.new_states` and writes each state as it is made,
    leaving a one-element stand-in in the optimizer; :meth:`read_state`, :meth:`write_state` and :meth:`state`
    are what checkpoints read and load."""

    def __init__(self, optim_layout, numels, policy: OffloadPolicy, world_rank: int):
        self.policy = policy
        self.state_attrs = optim_layout.state_attrs
        self.splits = splits_parameters(optim_layout.optimizer)
        self.dtypes = {attr: [s.dtype for s in optim_layout.states[attr]] for attr in self.state_attrs}
        itemsizes = [max((dtype_bytes(d) for d in self.dtypes[attr]), default=4) for attr in self.state_attrs]
        self.layout = StateLayout.build(numels, itemsizes, policy.chunk_bytes, self.splits)
        self.numels = tuple(int(n) for n in numels)
        self.names = {attr: [s.name for s in optim_layout.states[attr]] for attr in self.state_attrs}
        self.shapes = [None] * len(optim_layout.params)
        root = check_directory(policy.dir, self.layout.nbytes)
        _remove_stale(root)
        self.rank_dir = root / f"rank_{world_rank}"
        self.rank_dir.mkdir(exist_ok=True)
        self.file = StateFile(self.rank_dir / f"states_{socket.gethostname()}_{os.getpid()}_{next(_SERIAL)}.bin",
                              self.layout.nbytes, keep=policy.keep)
        self.reader, self.writer = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
        # at exit, or when the train step is dropped: threads stopped, file removed (unless kept)
        self._finalizer = weakref.finalize(self, _release, self.file, (self.reader, self.writer), self.rank_dir,
                                           policy.keep)
        self.placeholders = []

    def keep(self, attr, index, state):
        """Write ``state`` (optimizer parameter ``index``'s state ``attr``, as sharded) to the file; return the
        one-element stand-in the optimizer holds instead."""
        self.shapes[index] = tuple(state.shape)
        self.write_state(attr, index, state.asnumpy(), flush=False)  # the store's constructor makes it durable
        stand_in = Parameter(Tensor(np.zeros((1,), np_dtype(state.dtype))), name=state.name, requires_grad=False)
        self.placeholders.append(stand_in)
        return stand_in

    def state_array(self, buf, piece, attr):
        k = self.state_attrs.index(attr)
        at = self.layout.state_offsets(piece)[k]
        dtype = np.dtype(np_dtype(self.dtypes[attr][piece.index]))
        return buf[at:at + piece.numel * dtype.itemsize].view(dtype)

    def read_state(self, attr, index) -> np.ndarray:
        """Optimizer parameter ``index``'s state ``attr``, flat, read piece by piece."""
        out = []
        for piece in self.layout.pieces_of(index):
            buf = np.empty(self.layout.record_bytes(piece), np.uint8)
            self.file.read(buf, piece.offset)
            out.append(self.state_array(buf, piece, attr).copy())
        return np.concatenate(out) if out else np.zeros(0, np_dtype(self.dtypes[attr][index]))

    def write_state(self, attr, index, value, flush: bool = True) -> None:
        """Set optimizer parameter ``index``'s state ``attr`` to ``value`` (any shape of its size); ``flush``: make it
        durable and drop it from the page cache now."""
        flat = np.ascontiguousarray(value).reshape(-1)
        for piece in self.layout.pieces_of(index):
            buf = np.empty(self.layout.record_bytes(piece), np.uint8)
            self.file.read(buf, piece.offset)
            self.state_array(buf, piece, attr)[:] = flat[piece.start:piece.stop]
            self.file.write(buf, piece.offset)
        if flush:
            self.file.flush()

    def state(self, attr, index) -> DiskState:
        """What a checkpoint reads and loads for optimizer parameter ``index``'s state ``attr``."""
        return DiskState(self, attr, index, self.names[attr][index], self.dtypes[attr][index], self.shapes[index])

    def close(self) -> None:
        """Stop the I/O threads and remove the file (unless ``offload_keep``); also done at exit."""
        self._finalizer()


# what the graph decided at a step, for the streamed update after it (DiskStates.pending)
NO_UPDATE, UPDATE, SKIPPED = 0, 1, 2


class DiskStates(StateStore):
    """The optimizer states on disk (a :class:`~mindzero.engine.states.StateStore`).

    In the graph the store takes the reduced gradients (with accumulation into one buffer per optimizer parameter,
    as a graph's branch cannot return them; without, as the step's fourth output) and records in ``pending``
    what the graph decided at every step (:data:`UPDATE`, :data:`SKIPPED` for overflow, :data:`NO_UPDATE`). After
    the graph, :meth:`after_step` streams the update (module docstring) and runs the tail (write-back and EMA) as a
    small graph of its own.
    """

    def __init__(self, file: OffloadFile, optim_layout, accumulate: bool, tail: UpdateTail):
        super().__init__(tail)
        file.file.flush()  # the states written by keep()
        self.disk, self.layout, self.accumulate = file, optim_layout, accumulate
        params = list(optim_layout.params)
        self.grads = ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np_dtype(p.dtype))),
                                               name="zero_offload_grad." + p.name, requires_grad=False)
                                     for p in params] if accumulate else [])
        self.pending = Parameter(Tensor(NO_UPDATE, ms.int32), name="zero_offload_pending", requires_grad=False)
        self.scratch = (*file.placeholders, *self.grads, self.pending)  # stand-ins, gradients between steps, flag
        self.stream = _Stream(file, optim_layout)

    def construct(self, grads, after):
        if self.accumulate:
            return ops.depend(after, MAP(store, self.grads, grads))
        return after

    def handoff(self, due, skipped, grads):
        decided = ops.select(skipped, Tensor(SKIPPED, ms.int32), Tensor(UPDATE, ms.int32)) * ops.cast(due, ms.int32)
        ops.assign(self.pending, decided)
        if self.accumulate:
            return ()
        return grads

    def after_step(self, handoff) -> None:
        decided = int(self.pending.asnumpy())  # what the graph decided (class docstring)
        if decided == NO_UPDATE:
            return
        if decided == UPDATE:
            first = not self.stream.update_seconds
            self.stream.update(handoff if handoff else self.grads)
            if first:  # the views compiled: give the compiler's freed heap back, as after the step's compile
                release_host_memory()
        if not self.tail.empty:
            self.tail(Tensor(decided == SKIPPED, ms.bool_))

    def state(self, attr, index) -> DiskState:
        return self.disk.state(attr, index)

    def bytes(self) -> dict:
        return {"optimizer_moments": 0, "gradients": sum(nbytes(g) for g in self.grads),
                "optimizer_disk": self.disk.layout.nbytes, "disk_io_per_step": 2 * self.disk.layout.nbytes,
                "offload_buffers": self.stream.buffer_bytes}

    def describe(self) -> str:
        mib, layout = 2 ** 20, self.disk.layout
        cut = "cut inside parameters" if self.disk.splits else "whole parameters: this optimizer is not cut"
        return (f"{layout.nbytes / mib:.3f} MiB of optimizer states in {self.disk.file.path} ({len(layout.pieces)} "
                f"pieces of at most {layout.piece_bytes / mib:.3f} MiB, {cut}); per update {layout.nbytes / mib:.3f} "
                f"MiB read + {layout.nbytes / mib:.3f} MiB written; resident for the stream: "
                f"{self.stream.buffer_bytes / mib:.3f} MiB of slots and the gradient buffers (in gradients)")

    def close(self) -> None:
        self.disk.close()


class _Stream:
    """The streamed update of a filled :class:`OffloadFile`: three slots and the optimizer's views (module
    docstring). Not a Cell: its views are compiled and run on their own, never in the step's graph."""

    def __init__(self, file: OffloadFile, optim_layout):
        self.disk, self.layout, self.optim_layout = file, file.layout, optim_layout
        params = list(optim_layout.params)
        self.scalars = list(optim_layout.scalars.values())
        # a slot: [the piece's parameter values][its gradient][its states, as in the file]
        self.param_dtypes = [np.dtype(np_dtype(p.dtype)) for p in params]
        itemsizes = [d.itemsize for d in self.param_dtypes]
        self.gradient_at, self.states_at = gradient_at(self.layout, itemsizes), states_at(self.layout, itemsizes)
        self.slots = [aligned_buffer(self.states_at + self.layout.piece_bytes) for _ in range(SLOTS)]
        self.window_shapes = [tuple(params[p.index].shape) if p.numel == file.numels[p.index] else (p.numel,)
                              for p in self.layout.pieces]  # a whole parameter keeps its shape (a 0-d one counts)
        views, self.view_of = {}, []
        for k, (piece, shape) in enumerate(zip(self.layout.pieces, self.window_shapes)):
            key = (k % SLOTS, shape, str(params[piece.index].dtype),
                   tuple(str(file.dtypes[a][piece.index]) for a in file.state_attrs),
                   signature(optim_layout, piece.index, [tuple(p.shape) for p in params]))
            if key not in views:
                views[key] = self._view(len(views), piece, shape, self.slots[k % SLOTS])
            self.view_of.append(views[key])
        self.n_views = len(views)
        self.update_seconds = []  # wall time of each streamed update
        self.update_io = (0, 0)  # bytes read and written by the last one

    def _view(self, n, piece, shape, slot):
        """The view of the optimizer for pieces like ``piece`` held in ``slot``: its Parameters' memory is the
        slot's (bound once, never rebound: MindSpore's in-place kernels keep the memory they first ran on)."""
        def bound(array, name):
            p = Parameter(Tensor(np.zeros(shape, array.dtype)), name=name, requires_grad=False)
            p.set_data(Tensor.from_numpy(array.reshape(shape)))
            if not np.shares_memory(p.asnumpy(), array):
                raise RuntimeError(f"mindzero: disk offload needs a Parameter to share a numpy array's memory "
                                   f"(Tensor.from_numpy), and {name} does not on this MindSpore")
            return p

        param = bound(self._piece_array(slot, piece), f"zero_offload.{n}.param")
        grad = bound(self._piece_array(slot, piece, self.gradient_at), f"zero_offload.{n}.grad")
        states = {a: bound(self.disk.state_array(slot[self.states_at:], piece, a), f"zero_offload.{n}.{a}")
                  for a in self.disk.state_attrs}
        return _Applied(optimizer_view(self.optim_layout, [piece.index], [param], {a: [s] for a, s in states.items()},
                                       share_scalars=True), grad)

    def _piece_array(self, slot, piece, at: int = 0):
        """The region of ``slot`` at byte ``at`` as the piece's elements in its parameter's dtype: its values (0) or
        its gradient (``gradient_at``)."""
        dtype = self.param_dtypes[piece.index]
        return slot[at:at + piece.numel * dtype.itemsize].view(dtype)

    def update(self, grads) -> None:
        """Apply the optimizer to every piece, the gradients taken from ``grads`` (one Tensor or Parameter per
        optimizer parameter; module docstring)."""
        pieces, file = self.layout.pieces, self.disk.file
        if not pieces:
            return
        started, io_before = time.perf_counter(), (file.read_bytes, file.written_bytes)
        params = [p.asnumpy().reshape(-1) for p in self.optim_layout.params]
        grads = [g.asnumpy().reshape(-1) for g in grads]
        scalars = [(p.asnumpy(), p.asnumpy().copy()) for p in self.scalars]

        def states_of(k):
            return self.slots[k % SLOTS][self.states_at:self.states_at + self.layout.record_bytes(pieces[k])]

        def read(k):
            file.read(states_of(k), pieces[k].offset)

        def write(k):
            file.write(states_of(k), pieces[k].offset)

        writes = [None] * SLOTS
        pending = self.disk.reader.submit(read, 0)
        for k, piece in enumerate(pieces):
            pending.result()
            if k + 1 < len(pieces):
                nxt = (k + 1) % SLOTS
                if writes[nxt] is not None:
                    writes[nxt].result()
                    writes[nxt] = None
                pending = self.disk.reader.submit(read, k + 1)
            for live, before in scalars:
                live[...] = before
            slot = self.slots[k % SLOTS]
            values = params[piece.index][piece.start:piece.stop]
            window = self._piece_array(slot, piece)
            window[...] = values
            self._piece_array(slot, piece, self.gradient_at)[...] = grads[piece.index][piece.start:piece.stop]
            with without_process_cache():  # a view compiles at its first call
                self.view_of[k]()
            values[...] = window
            writes[k % SLOTS] = self.disk.writer.submit(write, k)
        for w in writes:
            if w is not None:
                w.result()
        self.disk.writer.submit(file.flush).result()
        self.update_seconds.append(time.perf_counter() - started)
        self.update_io = (file.read_bytes - io_before[0], file.written_bytes - io_before[1])

    @property
    def buffer_bytes(self) -> int:
        """Resident for the stream: the slots (the gradient buffers are counted as gradients)."""
        return sum(int(s.nbytes) for s in self.slots)


class _Applied(nn.Cell):
    """A view of the optimizer applied to the gradient in its slot (a Parameter bound to the slot's memory, as the
    piece's values and states are): the compiled view has no input, so it keeps no input buffer of its own (one
    per view, each the size of a piece, when the gradient was passed in as a Tensor)."""

    def __init__(self, view, grad):
        super().__init__(auto_prefix=False)
        self.view, self.grad = view, grad

    def construct(self):
        return self.view((self.grad,))


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed byte buffer whose first byte is at a multiple of :data:`ALIGN_BYTES` (see there why)."""
    raw = np.zeros(nbytes + ALIGN_BYTES, np.uint8)
    skip = -raw.ctypes.data % ALIGN_BYTES
    return raw[skip:skip + nbytes]


def _release(file, pools, rank_dir, keep) -> None:
    for pool in pools:
        pool.shutdown(wait=True)
    file.close()
    if not keep:
        try:
            rank_dir.rmdir()
        except OSError:
            pass


def _remove_stale(root: Path) -> None:
    """Remove state files left by this machine's processes that no longer run (a killed rank's scratch, never a
    checkpoint; files of other machines sharing the directory are left alone)."""
    for path in root.glob(f"rank_*/states_{socket.gethostname()}_*.bin"):
        try:
            pid = int(path.stem.rsplit("_", 2)[-2])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            try:
                path.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["DiskState", "DiskStates", "OffloadError", "OffloadFile"]

"""Saving a live train step's checkpoint: every rank writes its part, synchronously or in the background
(see :mod:`mindzero.checkpoint.live` for the directory's layout, integrity and atomicity).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..engine.optim import optimizer_step
from .format import COMPLETE, FORMATS, SplitInfo, fsync_dir, split_info_name, write_atomic, write_marker
from ..comm.cells import Barrier
from .directory import CheckpointError, trainer_state_name
from .live import live_tensors
from ..core.checksum import crc32_array
from .tensor_io import open_writer


def save_checkpoint(train_net, ckpt_dir, step=None, weights_only=False, format="ckpt", trainer_state=None,
                    async_save=False):
    """Save this train step's full training state into ``ckpt_dir``. Collective: all ranks call it.

    Every tensor is written with its CRC-32 (recorded in the split info); the ``COMPLETE`` marker, written
    last when every rank's files are durable, records every file's size and checksum.

    Args:
        train_net: from :func:`mindzero.prepare_train_network`.
        ckpt_dir: the checkpoint directory; it must not exist (a previous checkpoint is never overwritten).
        step: recorded in the split info (default: the optimizer's ``global_step``).
        weights_only: save network parameters only (no optimizer states or scalars).
        format: ``"ckpt"`` or ``"safetensors"``.
        trainer_state: ``None`` or a JSON-serialisable dict (e.g. epoch, data position, this rank's loss
            history), written by every rank as ``trainer_state_<rank>.json`` (world rank) inside the
            checkpoint; :func:`read_trainer_state`.
        async_save: copy what this rank saves to host memory, return, and write in a background thread
            (no collective there). Returns an :class:`AsyncSave`; the next save, :func:`wait_for_save`
            and process exit wait for it. Extra host memory: one copy of this rank's saved tensors
            (``AsyncSave.host_bytes``).

    Returns:
        the checkpoint's path (``async_save=True``: an :class:`AsyncSave` handle whose ``wait()`` returns it).

    Raises:
        CheckpointError: bad ``format``, ``ckpt_dir`` exists, called between micro-batches of an update, or
            a rank failed to write (e.g. a full disk): every rank raises, nothing complete is left.
    """
    state_bytes = _check_save(train_net, ckpt_dir, format, trainer_state)
    wait_for_save()  # an earlier asynchronous save completes first
    job, barrier = _make_job(train_net, Path(ckpt_dir), step, weights_only, format, state_bytes)
    if async_save:
        job.tensors = [(e, np.array(_host(p), copy=True)) for e, p in job.tensors]
        handle = AsyncSave(job)
        _PENDING.append(handle)
        return handle
    _write_together(job, barrier, train_net.zero_info.world)
    return job.final


def _check_save(train_net, ckpt_dir, format, trainer_state):
    """Refuse a save that cannot succeed, before any rank writes; returns the trainer state as JSON bytes."""
    if format not in FORMATS:
        raise CheckpointError(f"format must be one of {FORMATS}, got {format!r}")
    state_bytes = None
    if trainer_state is not None:
        try:
            state_bytes = json.dumps(trainer_state, indent=1, allow_nan=True).encode()
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"trainer_state must be a JSON-serialisable dict: {err}") from None
    if Path(ckpt_dir).exists():
        raise CheckpointError(f"ckpt_dir {str(ckpt_dir)!r} already exists; choose a new directory per checkpoint")
    info = train_net.zero_info
    k = info.config.gradient_accumulation_steps
    if info.accum_buffers and int(train_net.micro_step.asnumpy()) % k:
        raise CheckpointError("save_checkpoint must be called after an update step: "
                              f"{int(train_net.micro_step.asnumpy())} micro-batches taken, "
                              f"gradient_accumulation_steps={k}")
    return state_bytes


def _make_job(train_net, final: Path, step, weights_only: bool, format: str, state_bytes):
    """This rank's :class:`_SaveJob` (its split info, the tensors it writes, the marker's fields) and the
    barrier of the save. Collective: agrees on a run id and makes the ``.partial`` directory (rank 0)."""
    info = train_net.zero_info
    world = info.world
    barrier = Barrier(world)
    partial = final.with_name(final.name + ".partial")
    run_id = "-".join(f"{int(v):06x}" for v in barrier(np.random.randint(0, 1 << 24, size=3)))
    if world.world_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save
        partial.mkdir(parents=True)
    barrier()
    entries = [(e, p) for e, p in live_tensors(train_net, format) if not weights_only or e.kind == "parameter"]
    if step is None:
        step = optimizer_step(train_net.optimizer)
    split = SplitInfo(run_id, info.config.zero_stage, world.op_size, world.op_rank, int(step), format,
                      info.plan.fingerprint(), tuple(e for e, _ in entries), dp_size=world.dp_size,
                      dp_rank=world.dp_rank)
    marker = {"run_id": run_id, "step": int(step), "group_size": world.op_size, "replicas": world.dp_size,
              "weights_only": bool(weights_only)}
    job = _SaveJob(partial, final, split if world.writes_shards else None, state_bytes, world.world_rank,
                   world.world_size, marker)
    job.tensors = job.own(entries)
    return job, barrier


def _write_together(job, barrier, world) -> None:
    """Every rank writes its part; a rank that fails makes every rank raise (one count of failures), and
    rank 0 removes the ``.partial`` directory; otherwise rank 0 completes the checkpoint."""
    error = None
    try:
        job.write()
    except Exception as err:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = err
    failed = barrier.count(error is not None)
    if failed:
        if world.world_rank == 0:
            shutil.rmtree(job.partial, ignore_errors=True)
        barrier()
        where = f"this rank ({world.world_rank}): {error}" if error is not None else "another rank"
        raise CheckpointError(f"save to {str(job.final)!r} failed on {failed} rank(s), including {where}; nothing "
                              "was completed and earlier checkpoints are untouched") from error
    if world.world_rank == 0:
        job.complete()
    barrier()


def _host(p) -> np.ndarray:
    """A Parameter's values as a host array (bfloat16 as numpy's bfloat16; written by its bytes)."""
    return p.asnumpy()


class _SaveJob:
    """What one rank writes for one checkpoint: its files (each tensor with its CRC-32), its split info, its
    trainer state; rank 0 also the marker. Runs in the caller (synchronous save) or in a thread (no
    MindSpore call there: ``tensors`` are host copies)."""

    def __init__(self, partial, final, split, state_bytes, world_rank, world_size, marker):
        self.partial, self.final, self.split, self.state_bytes = Path(partial), Path(final), split, state_bytes
        self.world_rank, self.world_size, self.marker = world_rank, world_size, marker
        self.tensors = []

    def own(self, entries):
        """The entries whose pieces this rank writes: its own file (its shards, the states it owns), and rank 0
        also the shared files (every piece once). With hybrid sharding only replica 0 writes (the others hold
        the same shards)."""
        if self.split is None:
            return []
        rank = self.split.op_rank
        mine = f"rank_{rank}.{self.split.format}"
        return [(e, p) for e, p in entries
                if p is not None and (e.file == mine or (rank == 0 and not e.file.startswith("rank_")))]

    def write(self) -> None:
        if self.split is not None:
            crcs = {}
            by_file = {}
            for e, value in self.tensors:
                by_file.setdefault(e.file, []).append((e, value))
            for file, items in by_file.items():
                layout = [(e.key, e.dtype, tuple(value.shape)) for e, value in items]
                with open_writer(self.partial / file, self.split.format, layout) as writer:
                    for e, value in items:
                        array = value if isinstance(value, np.ndarray) else _host(value)
                        crcs[e.name] = crc32_array(array)
                        writer.write(e.key, array, e.dtype)
            # every entry of this rank; a shared piece another rank wrote has its checksum in that rank's entry
            self.split = replace(self.split, tensors=tuple(replace(e, crc32=crcs.get(e.name))
                                                           for e in self.split.tensors))
            self.split.write(self.partial / split_info_name(self.split.op_rank))
        if self.state_bytes is not None:
            write_atomic(self.partial / trainer_state_name(self.world_rank), self.state_bytes)

    def complete(self) -> None:
        """Rank 0, once every rank's files are durable: the marker, then the rename into place."""
        write_marker(self.partial, **self.marker)
        os.replace(self.partial, self.final)
        fsync_dir(self.final.parent)

    def run_async(self, timeout: float) -> None:
        """The background part: write, leave a flag (``.written_<rank>`` or ``.failed_<rank>``); rank 0 then
        waits for every rank's flag and completes the checkpoint, or removes it if a rank failed. Ranks
        agree through the (shared) checkpoint directory, not through collectives."""
        try:
            self.write()
        except Exception as err:
            write_atomic(self.partial / f".failed_{self.world_rank}", f"{type(err).__name__}: {err}".encode())
            raise
        write_atomic(self.partial / f".written_{self.world_rank}", b"ok")
        deadline = time.time() + timeout
        if self.world_rank != 0:  # done when rank 0 has renamed the directory into place (or removed it)
            while not (self.final / COMPLETE).is_file():
                if not self.partial.exists() and not (self.final / COMPLETE).is_file():
                    time.sleep(0.05)
                    if not (self.final / COMPLETE).is_file():
                        raise CheckpointError(f"{self.final}: another rank failed to write its part; the save "
                                              "was removed")
                if time.time() > deadline:
                    raise CheckpointError(f"{self.final}: rank 0 did not complete the checkpoint within "
                                          f"{timeout:.0f}s")
                time.sleep(0.05)
            return
        while True:
            failed = sorted(self.partial.glob(".failed_*"))
            if failed:
                reasons = "; ".join(f"rank {p.name.split('_')[1]}: {p.read_text()}" for p in failed)
                shutil.rmtree(self.partial, ignore_errors=True)
                raise CheckpointError(f"asynchronous save to {str(self.final)!r} failed ({reasons}); nothing was "
                                      "completed and earlier checkpoints are untouched")
            done = {p.name for p in self.partial.glob(".written_*")}
            if len(done) == self.world_size:
                break
            if time.time() > deadline:
                missing = sorted(set(range(self.world_size)) - {int(n.split("_")[1]) for n in done})
                shutil.rmtree(self.partial, ignore_errors=True)
                raise CheckpointError(f"asynchronous save to {str(self.final)!r}: ranks {missing} did not finish "
                                      f"writing within {timeout:.0f}s (killed?); the save was removed")
            time.sleep(0.05)
        for name in done:
            (self.partial / name).unlink()
        self.complete()


ASYNC_TIMEOUT = 1800.0  # seconds an asynchronous save waits for the other ranks' files


class AsyncSave:
    """A save running in the background (:func:`save_checkpoint` with ``async_save=True``).

    ``wait()`` blocks until the checkpoint is complete (on every rank: until rank 0 has written the
    marker and renamed it into place) and returns its path, or raises :class:`CheckpointError`.
    ``host_bytes``: the host memory held by the copies until the write ends.
    """

    def __init__(self, job: _SaveJob, timeout: float = ASYNC_TIMEOUT):
        self.path = job.final
        self.host_bytes = sum(int(v.nbytes) for _, v in job.tensors)
        self.error = None
        self._job = job
        self._thread = threading.Thread(target=self._run, args=(timeout,), name="mindzero-async-save", daemon=True)
        self._thread.start()

    def _run(self, timeout):
        try:
            self._job.run_async(timeout)
        except BaseException as err:  # noqa: BLE001 - reported by wait()
            self.error = err
        finally:
            self._job.tensors = []  # free the host copies

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout=None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(f"{self.path}: asynchronous save still running after {timeout}s")
        if self in _PENDING:
            _PENDING.remove(self)
        if self.error is not None:
            if isinstance(self.error, CheckpointError):
                raise self.error
            raise CheckpointError(f"asynchronous save to {str(self.path)!r} failed on this rank: {self.error}; nothing "
                                  "was completed and earlier checkpoints are untouched") from self.error
        return self.path


_PENDING = []


def wait_for_save():
    """Wait for this process's pending asynchronous saves (oldest first); raises the first failure."""
    while _PENDING:
        _PENDING[0].wait()


def _wait_at_exit():
    try:
        wait_for_save()
    except CheckpointError as err:
        print(f"mindzero: {err}", file=sys.stderr, flush=True)


atexit.register(_wait_at_exit)



"""Per-rank checkpoints of a live train step: save, resume, and full parameters on demand.

A checkpoint is a directory written by all ranks together:

* ``rank_<r>.<ext>``: what rank ``r`` alone holds: its shards (stage-3 parameters,
  sharded optimizer states) and its own buffers (e.g. BatchNorm statistics); rank 0's
  file also holds the replicated tensors (step counters, loss scale, replicated states);
* ``network.<ext>``: stages 0-2, the full network parameters, written once by rank 0;
* ``params_split_info_<r>.json``: the schema of :mod:`mindzero.split_info`, enough to rebuild
  every full tensor without model code;
* ``COMPLETE``: written last: every file's size, the JSON files' CRC-32, its own checksum.

Integrity: each rank writes its pieces itself (:mod:`mindzero.ckpt_io`, one tensor at a time) and
records each piece's CRC-32 in its split info; every reader (:func:`load_checkpoint`, merge, reshard,
``mindzero-verify``) checks them.

Atomicity: everything is written into ``<dir>.partial``; when every rank has written (a barrier, or
for an asynchronous save a flag file per rank) rank 0 writes ``COMPLETE`` and renames the directory
into place. A rank that fails to write (e.g. a full disk) makes every rank raise and the
``.partial`` directory is removed. A crash leaves at most a
``.partial`` directory, which nothing loads; an existing ``<dir>`` is never touched.
Master shards (stages 1-2) are slices of the saved full parameters and are rebuilt on
load, except in a ``param_dtype`` run, whose fp32 masters are saved (kind ``master``); accumulation
buffers are empty at an update step, the only time a save is allowed.
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
from mindspore import Tensor

from .ckpt_io import MS_TO_NAME, crc32_array, open_writer
from .comm import AllReduceSum, shared_cell
from .shard import GatherFull, shard_array
from .split_info import (COMPLETE, FORMATS, SplitInfo, entry_at, fsync_dir, split_info_name, write_atomic,
                         write_marker)


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong."""


def live_tensors(train_net, fmt: str = "ckpt") -> list:
    """``[(TensorEntry, Parameter)]`` for every tensor this rank's checkpoint holds, in a fixed order:
    network parameters (plan order), optimizer states, then scalars (step counters, loss scale).
    Where each lives follows :func:`mindzero.split_info.placement`."""
    info = train_net.zero_info
    stage = info.config.zero_stage
    out = []

    def add(name, kind, param_name, p):
        spec = info.plan[param_name] if param_name else None
        shape = spec.shape if spec else p.shape
        out.append((entry_at(name, kind, shape, MS_TO_NAME[str(p.dtype)], spec, stage, fmt), p))

    net_params = {p.name: p for p in train_net.network.get_parameters()}
    for spec in info.plan:
        add(spec.name, "parameter", spec.name, net_params[spec.name])
    for attr in info.state_attrs:
        for param_name, p in zip(info.opt_param_names, getattr(train_net.optimizer, attr)):
            add(p.name, "optimizer_state", param_name, p)
    if info.precision.enabled:  # the fp32 masters: not derivable from the param_dtype copies
        for param_name, p in zip(info.opt_param_names, train_net.optimizer.parameters):
            add(p.name, "master", param_name, p)
    if train_net.has_ema:
        for param_name, p in zip(info.opt_param_names, train_net.ema.ema_weights):
            add(p.name, "ema", param_name, p)
    taken = {id(p) for _, p in out}
    skip = {id(p) for p in (*info.master_shards, *info.accum_buffers, *train_net.optimizer.parameters)} | taken
    for p in train_net.get_parameters():
        if id(p) not in skip:
            add(p.name, "scalar", "", p)
    names = [e.name for e, _ in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"tensor names must be unique in a checkpoint, got {dup} more than once")
    return out


class _Barrier:
    """All ranks wait here; also agrees on a value chosen by rank 0 (a SUM in which the others add 0)."""

    def __init__(self, world):
        self.cell, self.rank = shared_cell(AllReduceSum, world), world.world_rank

    def __call__(self, values=(0.0,)):
        x = np.array(values, np.float32) if self.rank == 0 else np.zeros(len(values), np.float32)
        return self.cell(Tensor(x)).asnumpy()

    def count(self, flag: bool) -> int:
        """How many ranks passed ``flag=True`` (every rank contributes; also a barrier)."""
        return int(round(float(self.cell(Tensor(np.array([float(flag)], np.float32))).asnumpy()[0])))


def trainer_state_name(rank: int) -> str:
    return f"trainer_state_{rank}.json"


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
    if format not in FORMATS:
        raise CheckpointError(f"format must be one of {FORMATS}, got {format!r}")
    state_bytes = None
    if trainer_state is not None:
        try:
            state_bytes = json.dumps(trainer_state, indent=1, allow_nan=True).encode()
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"trainer_state must be a JSON-serialisable dict: {err}") from None
    info = train_net.zero_info
    final = Path(ckpt_dir)
    if final.exists():
        raise CheckpointError(f"ckpt_dir {str(final)!r} already exists; choose a new directory per checkpoint")
    if info.accum_buffers and int(train_net.micro_step.asnumpy()) % info.config.gradient_accumulation_steps:
        raise CheckpointError("save_checkpoint must be called after an update step: "
                              f"{int(train_net.micro_step.asnumpy())} micro-batches taken, "
                              f"gradient_accumulation_steps={info.config.gradient_accumulation_steps}")
    wait_for_save()  # an earlier asynchronous save completes first
    barrier = _Barrier(info.world)
    partial = final.with_name(final.name + ".partial")
    run_id = "-".join(f"{int(v):06x}" for v in barrier(np.random.randint(0, 1 << 24, size=3)))
    if info.world.world_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save
        partial.mkdir(parents=True)
    barrier()
    entries = [(e, p) for e, p in live_tensors(train_net, format) if not weights_only or e.kind == "parameter"]
    if step is None:
        step = int(train_net.optimizer.global_step.asnumpy().reshape(-1)[0])
    world = info.world
    split = SplitInfo(run_id, info.config.zero_stage, world.op_size, world.op_rank, int(step), format,
                      info.plan.fingerprint(), tuple(e for e, _ in entries), dp_size=world.dp_size,
                      dp_rank=world.dp_rank)
    marker = {"run_id": run_id, "step": int(step), "group_size": world.op_size, "replicas": world.dp_size,
              "weights_only": bool(weights_only)}
    job = _SaveJob(partial, final, split if world.writes_shards else None, state_bytes, world.world_rank,
                   world.world_size, marker)
    if async_save:
        job.tensors = [(e, np.array(_host(p), copy=True)) for e, p in job.own(entries)]
        handle = AsyncSave(job)
        _PENDING.append(handle)
        return handle
    job.tensors = [(e, p) for e, p in job.own(entries)]
    error = None
    try:
        job.write()
    except Exception as err:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = err
    failed = barrier.count(error is not None)
    if failed:
        if world.world_rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        where = f"this rank ({world.world_rank}): {error}" if error is not None else "another rank"
        raise CheckpointError(f"save to {str(final)!r} failed on {failed} rank(s), including {where}; nothing "
                              "was completed and earlier checkpoints are untouched") from error
    if world.world_rank == 0:
        job.complete()
    barrier()
    return final


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
        """The entries whose pieces this rank writes: its own file, and rank 0 also the shared files (every
        piece once). With hybrid sharding only replica 0 writes (the others hold the same shards)."""
        if self.split is None:
            return []
        rank = self.split.op_rank
        return [(e, p) for e, p in entries if e.file == f"rank_{rank}.{self.split.format}" or rank == 0]

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


def read_trainer_state(ckpt_dir, rank: int = 0) -> dict:
    """The ``trainer_state`` world rank ``rank`` saved with a checkpoint (``{}`` if none was)."""
    path = Path(ckpt_dir) / trainer_state_name(rank)
    if not (Path(ckpt_dir) / COMPLETE).is_file():
        raise CheckpointError(f"{ckpt_dir}: not a complete mindzero checkpoint (no {COMPLETE} marker)")
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(state).__name__}")
    return state


def complete_checkpoints(root, prefix: str = "step_") -> list:
    """The complete checkpoints ``root/<prefix>*`` (with a ``COMPLETE`` marker), oldest first by name;
    ``.partial`` leftovers of an interrupted save are skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(prefix + "*")
                  if p.suffix != ".partial" and (p / COMPLETE).is_file())


def latest_checkpoint(root, prefix: str = "step_"):
    """The newest complete checkpoint under ``root`` (:func:`complete_checkpoints`), or ``None``."""
    done = complete_checkpoints(root, prefix)
    return done[-1] if done else None


def load_checkpoint(train_net, ckpt_dir):
    """Resume ``train_net`` from ``ckpt_dir``, saved at any world size, stage or hybrid layout.

    Every rank calls it (no communication). The same layout restores bit for bit; another one restores
    exactly what ``mindzero-reshard`` to this layout followed by a load would: each rank reads only the
    stored pieces that overlap its own (about one tensor of memory at most). Every piece read is checked
    against its CRC-32 and the marker's file list first. A checkpoint of a ``param_dtype`` run loaded by a
    run without one restores the fp32 master values into the parameters; the other way round the masters
    are taken from the saved parameters.

    Returns:
        rank 0's :class:`mindzero.split_info.SplitInfo` of the checkpoint (``.step``, ``.stage``, ...).

    Raises:
        CheckpointError: an incomplete, corrupted or foreign checkpoint, or parameter names or shapes
            that differ from the network's (the message says which). Everything is read and verified
            before the first parameter changes, so a failed load leaves the train step as it was.
    """
    info = train_net.zero_info
    error, values, saved = None, [], None
    try:
        values, saved = _read_for_load(train_net, ckpt_dir)
    except CheckpointError as err:
        error = err
    failed = _Barrier(info.world).count(error is not None)  # every rank loads, or none does
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{ckpt_dir}: {failed} other rank(s) could not load their part (their logs say "
                              "why); nothing was loaded")
    loaded = set()
    for entry, p, value in values:
        p.set_data(Tensor(value, p.dtype))
        loaded.add(entry.name)
    for pair in info.master_pairs:  # masters the checkpoint does not hold: from the loaded parameters
        if pair.master.name in loaded:
            continue
        value = pair.held.asnumpy()
        if pair.shard_of_full:
            value = shard_array(value, info.plan[pair.held.name])
        pair.master.set_data(Tensor(value.astype(np.float32) if info.precision.enabled else value,
                                    pair.master.dtype))
    for buf in info.accum_buffers:
        buf.set_data(Tensor(np.zeros(buf.shape, np.float32), buf.dtype))
    return saved


def _read_for_load(train_net, ckpt_dir) -> list:
    """``([(entry, Parameter, value)], rank 0's split info)``: everything this rank loads, read and verified."""
    from .merge import Source

    info = train_net.zero_info
    src = Source(ckpt_dir, check_pieces=False, error=CheckpointError)
    ckpt_dir = src.dir
    live = live_tensors(train_net, src.ref.format)
    _check_same_parameters(ckpt_dir, src.ref, live)
    masters = {t.param: t.name for t in src.ref.tensors if t.kind == "master"}
    params = {t.name for t in src.ref.tensors if t.kind == "parameter"}
    values = []  # read and verify everything before changing anything
    for entry, p in live:
        name = entry.name
        if entry.kind == "parameter" and not info.precision.enabled and name in masters:
            name = masters[name]  # a param_dtype checkpoint into a full-precision run: the fp32 masters
        elif entry.kind == "master" and not src.has(name) and entry.param in params:
            name = entry.param  # a full-precision checkpoint into a param_dtype run: masters from its values
        if not src.has(name):
            if entry.kind == "parameter":
                raise CheckpointError(f"{ckpt_dir}: has no tensor {name!r}")
            continue  # weights-only checkpoint: optimizer state stays as it is
        target = replace(entry, name=name, dtype=src.entry(name).dtype)
        value = src.piece_for(target, info.world.op_rank)
        if value.size != int(np.prod(p.shape)):
            raise CheckpointError(f"{ckpt_dir}: tensor {name!r} gives shape {value.shape}, the network's "
                                  f"{entry.name!r} has {tuple(p.shape)}")
        values.append((entry, p, value.reshape(p.shape)))
    return values, src.ref


def _check_same_parameters(ckpt_dir, saved: SplitInfo, live) -> None:
    have = {e.name: e.shape for e in saved.tensors if e.kind == "parameter"}
    want = {e.name: e.shape for e, _ in live if e.kind == "parameter"}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    shapes = sorted(n for n in set(have) & set(want) if tuple(have[n]) != tuple(want[n]))
    if missing or extra or shapes:
        detail = [f"the network has parameters the checkpoint lacks: {missing[:5]}" if missing else "",
                  f"the checkpoint has parameters the network lacks: {extra[:5]}" if extra else "",
                  "; ".join(f"{n}: checkpoint {tuple(have[n])}, network {tuple(want[n])}" for n in shapes[:5])]
        raise CheckpointError(f"{ckpt_dir}: checkpoint does not match the network: "
                              + "; ".join(d for d in detail if d))


def gather_full_state_dict(train_net, ema: bool = False, masters: bool = False) -> dict:
    """Every network parameter, full, under its original name: ``{name: numpy.ndarray}``.

    With ``ema=True`` the optimized parameters' values are their exponential moving averages
    (``prepare_train_network(..., ema=...)``), the weights to evaluate or export. With ``masters=True``
    (a ``param_dtype`` run) they are the fp32 master values the optimizer updates.

    Collective: all ranks must call it (stage 3 all-gathers each shard, one tensor at a time: the
    device holds one full tensor beyond the shards, the host the result).
    """
    info = train_net.zero_info
    out = {}
    policy = info.config.policy
    plan_names = {s.name for s in info.plan}
    sharded_names = {s.name for s in info.plan if s.sharded} if policy.shard_parameters else set()
    params = list(train_net.network.get_parameters())
    if masters:
        if ema:
            raise ValueError("gather_full_state_dict: pass ema=True or masters=True, not both")
        by_name = {pair.master.name: pair.master for pair in info.master_pairs} if info.precision.enabled else {}
        if not by_name:
            raise ValueError("gather_full_state_dict(masters=True): this train step keeps no fp32 masters; pass "
                             "param_dtype to prepare_train_network")
        params = [by_name.get("zero_master." + p.name, p) for p in params]
        sharded_names = {s.name for s in info.plan if s.sharded} if policy.shard_optimizer_states else set()
    if ema:
        if not train_net.has_ema:
            raise ValueError("gather_full_state_dict(ema=True): this train step has no EMA; pass ema= to "
                             "prepare_train_network")
        averages = dict(zip(info.opt_param_names, train_net.ema.ema_weights))
        params = [averages.get(p.name, p) for p in params]
    gathers = {}  # GatherFull.key -> GatherFull: one compile per distinct shape
    for p in params:
        name = p.name
        prefix = "ema." if ema else "zero_master." if masters else None
        if prefix and name.startswith(prefix) and name[len(prefix):] in plan_names:
            name = name[len(prefix):]
        if name in sharded_names:
            spec = info.plan[name]
            key = GatherFull.key(spec)
            if key not in gathers:
                gathers[key] = GatherFull(spec, info.world)
            out[name] = gathers[key](p).asnumpy()
        else:
            out[name] = p.asnumpy().copy()
    return {s.name: out[s.name] for s in info.plan}


def save_full_checkpoint(train_net, path, format="ckpt"):
    """Gather the full network parameters (collective) and write them on rank 0 to ``path``, loadable
    into the plain network with ``mindspore.load_checkpoint`` + ``load_param_into_net``."""
    import mindspore as ms

    if format not in FORMATS:
        raise CheckpointError(f"format must be one of {FORMATS}, got {format!r}")
    full = gather_full_state_dict(train_net)
    path = Path(path)
    if not path.name.endswith("." + format):
        raise CheckpointError(f"path must end with .{format} for format={format!r}, got {str(path)!r}")
    if train_net.zero_info.world.world_rank == 0:
        tmp = path.with_name(f".partial-{os.getpid()}-{path.name}")  # keeps the suffix MindSpore checks
        ms.save_checkpoint([{"name": n, "data": Tensor(v)} for n, v in full.items()], str(tmp), format=format)
        os.replace(tmp, path)
    _Barrier(train_net.zero_info.world)()
    return path

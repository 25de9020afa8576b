"""Per-rank checkpoints of a live train step: save, resume, and full parameters on demand.

A checkpoint is a directory written by all ranks together:

* ``rank_<r>.<ext>``: what rank ``r`` alone holds: its shards (stage-3 parameters,
  sharded optimizer states) and its own buffers (e.g. BatchNorm statistics); rank 0's
  file also holds the replicated tensors (step counters, loss scale, replicated states);
* ``network.<ext>``: stages 0-2, the full network parameters, written once by rank 0;
* ``params_split_info_<r>.json``: the schema of :mod:`mindzero.split_info`, enough to rebuild
  every full tensor without model code;
* ``COMPLETE``: written last.

Atomicity: everything is written into ``<dir>.partial``; after a barrier rank 0 writes
``COMPLETE`` and renames the directory into place. A crash leaves at most a
``.partial`` directory, which nothing loads; an existing ``<dir>`` is never touched.
Master shards (stages 1-2) are slices of the saved full parameters and are rebuilt on
load, except in a ``param_dtype`` run, whose fp32 masters are saved (kind ``master``); accumulation
buffers are empty at an update step, the only time a save is allowed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from mindspore import Tensor

from .ckpt_io import MS_TO_NAME, open_reader
from .comm import AllReduceSum, shared_cell
from .plan import REASON_NOT_OPTIMIZED
from .shard import GatherFull, shard_array
from .split_info import COMPLETE, FORMATS, SplitInfo, entry_at, split_info_name, write_atomic


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong."""


def live_tensors(train_net, fmt: str = "ckpt") -> list:
    """``[(TensorEntry, Parameter)]`` for every tensor this rank's checkpoint holds, in a fixed order:
    network parameters (plan order), optimizer states, then scalars (step counters, loss scale).
    Where each lives follows :func:`mindzero.split_info.placement`."""
    info = train_net.zero_info
    stage, rank = info.config.zero_stage, info.world.rank
    out = []

    def add(name, kind, param_name, p, per_rank=False):
        spec = info.plan[param_name] if param_name else None
        shape = spec.shape if spec else p.shape
        out.append((entry_at(name, kind, param_name, shape, MS_TO_NAME[str(p.dtype)], spec, per_rank, stage, rank,
                             fmt), p))

    net_params = {p.name: p for p in train_net.network.get_parameters()}
    for spec in info.plan:
        add(spec.name, "parameter", spec.name, net_params[spec.name], spec.reason == REASON_NOT_OPTIMIZED)
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


def trainer_state_name(rank: int) -> str:
    return f"trainer_state_{rank}.json"


def save_checkpoint(train_net, ckpt_dir, step=None, weights_only=False, format="ckpt", trainer_state=None):
    """Save this train step's full training state into ``ckpt_dir``. Collective: all ranks call it.

    Args:
        train_net: from :func:`mindzero.prepare_train_network`.
        ckpt_dir: the checkpoint directory; it must not exist (a previous checkpoint is never overwritten).
        step: recorded in the split info (default: the optimizer's ``global_step``).
        weights_only: save network parameters only (no optimizer states or scalars).
        format: ``"ckpt"`` or ``"safetensors"``.
        trainer_state: ``None`` or a JSON-serialisable dict (e.g. epoch, data position, this rank's loss
            history), written by every rank as ``trainer_state_<rank>.json`` (world rank) inside the
            checkpoint; :func:`read_trainer_state`.

    Raises:
        CheckpointError: bad ``format``, ``ckpt_dir`` exists, or called between micro-batches of an update.
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
    if info.world.writes_shards:  # with hybrid sharding replica 0 writes; the others hold the same shards
        _write_rank_files(entries, partial, info.world.rank, format)
        SplitInfo(run_id, info.config.zero_stage, info.world.group_size, info.world.rank, int(step), format,
                  info.plan.fingerprint(), tuple(e for e, _ in entries), replicas=info.world.replicas,
                  replica=info.world.replica).write(partial / split_info_name(info.world.rank))
    if state_bytes is not None:
        write_atomic(partial / trainer_state_name(info.world.world_rank), state_bytes)
    barrier()
    if info.world.world_rank == 0:
        marker = {"run_id": run_id, "step": int(step), "group_size": info.world.group_size,
                  "replicas": info.world.replicas,
                  "weights_only": bool(weights_only), "files": sorted(os.listdir(partial))}
        write_atomic(partial / COMPLETE, json.dumps(marker, indent=1).encode())
        os.replace(partial, final)
    barrier()
    return final


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


def _write_rank_files(entries, directory: Path, rank: int, fmt: str) -> None:
    """This rank writes its own file, and rank 0 also the shared ones (every file once)."""
    import mindspore as ms

    by_file = {}
    for e, p in entries:
        if e.file == f"rank_{rank}.{fmt}" or rank == 0:
            by_file.setdefault(e.file, []).append((e, p))
    for file, items in by_file.items():
        path = directory / file
        ms.save_checkpoint([{"name": e.key, "data": p} for e, p in items], str(path), format=fmt)
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def load_checkpoint(train_net, ckpt_dir):
    """Resume ``train_net`` from ``ckpt_dir`` saved with the same world size and stage (bit-identical).

    Every rank calls it (no communication). For another world size or stage, convert the
    checkpoint first with ``mindzero-reshard``.

    Raises:
        CheckpointError: an incomplete or foreign checkpoint, another stage or group size, or
            parameter names or shapes that differ from the network's (the message says which).
    """
    info = train_net.zero_info
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / COMPLETE).is_file():
        raise CheckpointError(f"{ckpt_dir}: not a complete mindzero checkpoint (no {COMPLETE} marker; "
                              "an interrupted save leaves only a .partial directory)")
    saved = SplitInfo.read(ckpt_dir / split_info_name(info.world.rank))
    for field, want in (("group_size", info.world.group_size), ("stage", info.config.zero_stage)):
        if getattr(saved, field) != want:
            raise CheckpointError(f"{ckpt_dir}: saved with {field}={getattr(saved, field)}, this run has {want}; "
                                  f"convert it with: mindzero-reshard {ckpt_dir} -o OUT --world-size "
                                  f"{info.world.group_size} --stage {info.config.zero_stage}")
    live = live_tensors(train_net, saved.format)
    _check_same_parameters(ckpt_dir, saved, live)
    by_name = saved.by_name()
    readers = {}
    loaded = set()
    for entry, p in live:
        if entry.name not in by_name:
            if entry.kind == "parameter":
                raise CheckpointError(f"{ckpt_dir}: has no tensor {entry.name!r}")
            continue  # weights-only checkpoint: optimizer state stays as it is
        src = by_name[entry.name]
        if src.file not in readers:
            readers[src.file] = open_reader(ckpt_dir / src.file)
        value = readers[src.file].read(src.key)
        if tuple(value.shape) != tuple(p.shape):
            raise CheckpointError(f"{ckpt_dir / src.file}: tensor {src.key!r} has shape {value.shape}, "
                                  f"the network's {entry.name!r} has {tuple(p.shape)}")
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

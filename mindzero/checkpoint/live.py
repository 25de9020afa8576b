"""Per-rank checkpoints of a live train step: what a rank's checkpoint holds (:func:`live_tensors`), resume
(:func:`load_checkpoint`), full parameters on demand; saving is :mod:`mindzero.checkpoint.save`.

A checkpoint is a directory written by all ranks together:

* ``rank_<r>.<ext>``: what rank ``r`` alone holds: its shards (stage-3 parameters,
  sharded optimizer states) and its own buffers (e.g. BatchNorm statistics); rank 0's
  file also holds the replicated tensors (step counters, loss scale, replicated states);
* ``network.<ext>``: stages 0-2, the full network parameters, written once by rank 0;
* ``params_split_info_<r>.json``: the schema of :mod:`mindzero.checkpoint.format`, enough to rebuild
  every full tensor without model code;
* ``COMPLETE``: written last: every file's size, the JSON files' CRC-32, its own checksum.

Integrity: each rank writes its pieces itself (:mod:`mindzero.checkpoint.tensor_io`, one tensor at a time) and
records each piece's CRC-32 in its split info; every reader (:func:`load_checkpoint`, merge, reshard,
``mindzero-verify``) checks them.

Atomicity: everything is written into ``<dir>.partial``; when every rank has written (a barrier, or
for an asynchronous save a flag file per rank) rank 0 writes ``COMPLETE`` and renames the directory
into place. A rank that fails to write (e.g. a full disk) makes every rank raise and the
``.partial`` directory is removed. A crash leaves at most a
``.partial`` directory, which nothing loads; an existing ``<dir>`` is never touched.
Master shards (stages 1-2) are slices of the saved full parameters and are rebuilt on
load, except in a ``param_dtype`` run, whose fp32 masters are saved (kind ``master``); a split parameter
(stage 1 without ``param_dtype``) is saved and loaded as its full value (:class:`~mindzero.engine.split.FullView`); accumulation
buffers are empty at an update step, the only time a save is allowed.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from mindspore import Tensor

from ..comm.backends import backend_of
from ..comm.cells import Barrier
from ..core.plan import shard_array
from ..engine.split import network_values
from .directory import CheckpointError
from .format import SplitInfo, entry_at
from .tensor_io import MS_TO_NAME


def live_tensors(train_net, fmt: str = "ckpt") -> list:
    """``[(TensorEntry, Parameter)]`` for every tensor this rank's checkpoint holds, in a fixed order:
    network parameters (plan order), optimizer states, then scalars (step counters, loss scale).
    Where each lives follows :func:`mindzero.checkpoint.format.placement`."""
    info = train_net.zero_info
    stage = info.config.zero_stage
    out = []

    def add(name, kind, param_name, p):
        spec = info.plan[param_name] if param_name else None
        shape = spec.shape if spec else p.shape
        out.append((entry_at(name, kind, shape, MS_TO_NAME[str(p.dtype)], spec, stage, fmt), p))

    net_params = network_values(train_net)
    for spec in info.plan:
        add(spec.name, "parameter", spec.name, net_params[spec.name])
    disk = info.offload  # optimizer_offload="disk": the states are read from (and loaded into) its file
    for attr in info.state_attrs:
        for i, (param_name, p) in enumerate(zip(info.opt_param_names, getattr(train_net.optimizer, attr))):
            add(p.name, "optimizer_state", param_name, disk.state(attr, i) if disk is not None else p)
    if info.precision.enabled:  # the fp32 masters: not derivable from the param_dtype copies
        for param_name, p in zip(info.opt_param_names, train_net.optimizer.parameters):
            add(p.name, "master", param_name, p)
    if train_net.has_ema:
        for param_name, p in zip(info.opt_param_names, train_net.ema.ema_weights):
            add(p.name, "ema", param_name, p)
    taken = {id(p) for _, p in out}
    rests = [pair.held for pair in info.split_pairs]  # saved within their parameters' full values
    scratch = (*disk.placeholders, *disk.grads) if disk is not None else ()  # stand-ins, gradients between steps
    skip = {id(p) for p in (*info.master_shards, *rests, *info.accum_buffers, *train_net.optimizer.parameters,
                            *scratch)} | taken
    for p in train_net.get_parameters():
        if id(p) not in skip:
            add(p.name, "scalar", "", p)
    names = [e.name for e, _ in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"tensor names must be unique in a checkpoint, got {dup} more than once")
    return out


def load_checkpoint(train_net, ckpt_dir):
    """Resume ``train_net`` from ``ckpt_dir``, saved at any world size, stage or hybrid layout.

    Every rank calls it (no communication). The same layout restores bit for bit; another one restores
    exactly what ``mindzero-reshard`` to this layout followed by a load would: each rank reads only the
    stored pieces that overlap its own (about one tensor of memory at most). Every piece read is checked
    against its CRC-32 and the marker's file list first. A checkpoint of a ``param_dtype`` run loaded by a
    run without one restores the fp32 master values into the parameters; the other way round the masters
    are taken from the saved parameters.

    Returns:
        rank 0's :class:`mindzero.checkpoint.format.SplitInfo` of the checkpoint (``.step``, ``.stage``, ...).

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
    failed = Barrier(info.world).count(error is not None)  # every rank loads, or none does
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
    from .source import Source

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
    return dict(iter_full_tensors(train_net, ema=ema, masters=masters))


def iter_full_tensors(train_net, names=None, ema: bool = False, masters: bool = False):
    """``(name, full numpy array)`` of each network parameter in ``names`` (default: all, in plan order),
    one at a time; ``ema`` / ``masters`` as :func:`gather_full_state_dict`. Collective: every rank iterates
    to the end (stage 3 all-gathers each shard)."""
    info = train_net.zero_info
    policy, optimized = info.config.policy, set(info.opt_param_names)
    if ema and masters:
        raise ValueError("gather_full_state_dict: pass ema=True or masters=True, not both")
    values = network_values(train_net)
    if masters:
        if not info.precision.enabled:
            raise ValueError("gather_full_state_dict(masters=True): this train step keeps no fp32 masters; pass "
                             "param_dtype to prepare_train_network")
        values.update((pair.held.name, pair.master) for pair in info.master_pairs)
    if ema:
        if not train_net.has_ema:
            raise ValueError("gather_full_state_dict(ema=True): this train step has no EMA; pass ema= to "
                             "prepare_train_network")
        values.update(zip(info.opt_param_names, train_net.ema.ema_weights))

    def is_shard(name):  # where this rank holds a shard of what is asked for
        if not info.plan[name].sharded:
            return False
        if masters and name in optimized:  # masters are sharded where the optimizer's states are
            return policy.shard_optimizer_states
        return policy.shard_parameters

    gather = backend_of(info.world).host_gather()  # eager: no graph compiled per shape
    for name in names if names is not None else [s.name for s in info.plan]:
        p = values[name]
        if is_shard(name):
            spec = info.plan[name]
            yield name, gather(p.value())[:spec.numel].reshape(spec.shape)
        else:
            yield name, p.asnumpy().copy()

"""Per-rank checkpoints of a live train step: what a rank's checkpoint holds (:func:`live_tensors`), resume
(:func:`load_checkpoint`), full parameters on demand; saving is :mod:`mindzero.checkpoint.save`.

A checkpoint is a directory written by all ranks together:

* ``rank_<r>.<ext>``: what rank ``r`` alone holds: its shards (stage-3 parameters,
  sharded optimizer states), the states of the parameters it owns (owner mode, whole) and its own
  buffers (e.g. BatchNorm statistics); rank 0's file also holds the replicated tensors (step
  counters, loss scale, replicated states);
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
Masters without ``param_dtype`` (stage 1-2 master shards, a stage-3 owner's full master) are the saved parameters'
values and are rebuilt on load; a ``param_dtype`` run's fp32 masters are saved (kind ``master``). Accumulation
buffers are empty at an update step, the only time a save is allowed.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from mindspore import Parameter, Tensor, ops

from ..comm.backends import backend_of
from ..comm.cells import Barrier
from ..core.optim_plan import ELEMENT, FLAT, OWNER
from ..core.plan import shard_array
from ..core.state import BROADCAST, GATHER
from .directory import CheckpointError
from .format import SplitInfo, Target, entry_at
from .tensor_io import MS_TO_NAME


def live_tensors(train_net, fmt: str = "ckpt") -> list:
    """``[(TensorEntry, Parameter or None)]`` for every tensor of the checkpoint, in a fixed order: network
    parameters (plan order), optimizer states, masters, EMA, then scalars (step counters, loss scale). Every rank
    lists every entry; the value is ``None`` where another rank holds the tensor (an owner-mode parameter's states
    and master on every rank but its owner). Where each lives follows :func:`mindzero.checkpoint.format.placement`."""
    info = train_net.zero_info
    op_rank, layout = info.world.op_rank, info.layout
    target = Target(info.config.zero_stage, fmt)
    out = []

    def add(name, kind, spec, value, shape=None, dtype=None, owner=None, whole=False):
        dtype = dtype or MS_TO_NAME[str(value.dtype)]
        out.append((entry_at(name, kind, spec.shape if shape is None else shape, dtype, spec, target, owner, whole),
                    value))

    net_params = {p.name: p for p in train_net.network.get_parameters()}
    for spec in info.plan:
        add(spec.name, "parameter", spec, net_params[spec.name])
    store = train_net.states  # where the states are (mindzero.engine.states): memory, or a file
    for i, ps in enumerate(info.params):
        owner = ps.update.owner if ps.update.mode == OWNER else None
        for st in ps.update.states:
            value = None if owner not in (None, op_rank) else store.state(st.attr, i)
            add(st.name, "optimizer_state", ps.spec, value, st.shape, st.dtype, owner,
                whole=st.layout != ELEMENT or ps.update.mode != FLAT)
    if info.precision.enabled:  # the fp32 masters: not derivable from the param_dtype copies
        for ps in info.params:
            owner = ps.update.owner if ps.update.mode == OWNER else None
            value = ps.master.master if ps.master is not None else None
            add("zero_master." + ps.name, "master", ps.spec, value, dtype="float32", owner=owner)
    if train_net.has_ema:
        for param_name, p in zip(info.opt_param_names, train_net.ema.ema_weights):
            add(p.name, "ema", info.plan[param_name], p)
    taken = {id(p) for _, p in out if p is not None}
    states = [s for group in layout.states.values() for s in group]  # incl. a non-owner's stand-ins
    skip = {id(p) for p in (*info.master_shards, *info.accum_buffers, *layout.params, *states, *store.scratch,
                            info.order)} | taken
    for p in train_net.get_parameters():
        if id(p) not in skip:
            out.append((entry_at(p.name, "scalar", p.shape, MS_TO_NAME[str(p.dtype)], None, target), p))
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
    for _, p, value in values:
        write_value(p, value)
    for buf in info.accum_buffers:
        write_value(buf, np.zeros(buf.shape, np.float32))
    return saved


def write_value(param, value) -> None:
    """``param := value`` (a numpy array of its size), in place: an assign kernel writes the memory the compiled
    step uses. ``set_data`` rebinds the Parameter instead, and a step already compiled goes on reading the old
    memory (an owner's full master loaded after two steps, at stage 3, did). A disk-offloaded
    state (:class:`~mindzero.engine.offload.DiskState`) writes its file."""
    tensor = Tensor(np.asarray(value).reshape(param.shape), param.dtype)
    if isinstance(param, Parameter):
        ops.assign(param, tensor)
    else:
        param.set_data(tensor)


def _read_for_load(train_net, ckpt_dir) -> list:
    """``([(entry, Parameter, value)], rank 0's split info)``: everything this rank loads, read and verified; the
    masters the checkpoint does not hold come from its parameters' values (a flat master shard is this rank's slice,
    an owner's master the whole parameter)."""
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
        if p is None:  # held by another rank (an owner's state)
            continue
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
    if not info.precision.enabled:  # masters beside full-precision parameters: their values
        for ps in info.params:
            pair = ps.master
            if pair is None or not src.has(masters.get(ps.name, ps.name)):
                continue
            full = src.full(masters.get(ps.name, ps.name))
            value = shard_array(full, info.plan[ps.name]) if pair.kind == GATHER else full
            values.append((None, pair.master, value.reshape(pair.master.shape)))
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
    to the end (stage 3 all-gathers each shard; an owner-mode parameter's fp32 master is broadcast from its
    owner)."""
    info = train_net.zero_info
    policy = info.config.policy
    if ema and masters:
        raise ValueError("gather_full_state_dict: pass ema=True or masters=True, not both")
    values = {p.name: p for p in train_net.network.get_parameters()}
    shards = {name for name in values if info.plan[name].sharded and policy.shard_parameters}
    owned = {}
    if masters:
        if not info.precision.enabled:
            raise ValueError("gather_full_state_dict(masters=True): this train step keeps no fp32 masters; pass "
                             "param_dtype to prepare_train_network")
        for ps in info.params:
            if ps.update.mode == OWNER:
                owned[ps.name] = ps
            elif ps.master is not None:
                values[ps.name] = ps.master.master
                if ps.master.kind == GATHER:
                    shards.add(ps.name)
    if ema:
        if not train_net.has_ema:
            raise ValueError("gather_full_state_dict(ema=True): this train step has no EMA; pass ema= to "
                             "prepare_train_network")
        values.update(zip(info.opt_param_names, train_net.ema.ema_weights))
    backend = backend_of(info.world)
    gather = backend.host_gather()  # eager: no graph compiled per shape
    for name in names if names is not None else [s.name for s in info.plan]:
        spec = info.plan[name]
        if name in owned:
            ps = owned[name]
            mine = ps.update.owned_by(info.world.op_rank)
            value = ps.master.master.value() if mine else Tensor(np.zeros(spec.shape, np.float32))
            yield name, backend.host_broadcast(ps.update.owner)(value).reshape(spec.shape)
        elif name in shards:
            yield name, gather(values[name].value())[:spec.numel].reshape(spec.shape)
        else:
            yield name, values[name].asnumpy().copy()

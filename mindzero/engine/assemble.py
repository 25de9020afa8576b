"""Assembling a train step's state: the partition plan, one :class:`~mindzero.core.state.ParamState` per
optimized parameter (its shard, master and buffers), the communication buckets, the loss scale and the EMA,
into one :class:`~mindzero.core.state.ZeroState`, made once and complete.
"""
from __future__ import annotations

import dataclasses

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ..core.comm_plan import state_calls, step_buckets
from ..core.config import LossScale, ZeroConfig
from ..core.introspect import param_infos
from ..core.plan import PartitionPlan
from ..core.state import MasterPair, ParamState, ZeroState
from ..core.topology import World
from .consistency import check_same_plan, check_same_values
from .materialize import make_shard, materialize
from .offload import DiskOffload
from .optim import check_optimizer, offload_update, optimizer_states, repoint_optimizer, shard_optimizer
from .split import FullView, split_layout, split_network_parameters, splittable
from .stage3 import check_pynative_recompute, shard_network_parameters
from .train_step import ZeroEMA


def assemble(network, optimizer, config: ZeroConfig, world: World) -> ZeroState:
    """The :class:`ZeroState` of ``network`` and ``optimizer`` under ``config`` on this rank of ``world``:
    checks the optimizer and the precision policy, plans, checks the plan across ranks, shards (network
    parameters at stage 3, master shards at stages 1-2, the optimizer's states from stage 1; lazily built
    Parameters are materialised one tensor at a time), checks the initial values across ranks, and makes
    the accumulation buffers, the buckets, the loss scale and the EMA.

    Communication: the plan and value checks (two small all-gathers).
    """
    policy, precision = config.policy, config.precision
    check_optimizer(optimizer, {p.name: p for p in network.get_parameters()}, policy.shard_optimizer_states,
                    world.device)
    if config.offload.host:
        offload_update(optimizer)
    plan = build_plan(network, optimizer, world, config)
    check_same_plan(plan, world, config.zero_stage)
    params = _param_states(optimizer, plan, config)
    sharded = _shard_state(network, optimizer, config, world, plan, params)
    check_same_values(plan, sharded.digests, world)
    _accumulation_buffers(config, params)
    micro, boundary, gather = step_buckets(params, policy, config.fusion)
    scale_sense, manager = _loss_scale(config.loss_scale)
    ema = None
    if config.ema is not None:
        ema = ZeroEMA([FullView(ps.master.master, ps.master.held, ps.spec) if ps.master is not None and ps.master.split
                       else ps.weight for ps in params], config.ema.decay, config.ema.updates,
                      ms.float32 if precision.enabled else None)
    regather = config.stage3.for_mode(ms.get_context("mode") == ms.GRAPH_MODE).regather
    state = ZeroState(config, world, plan, params, micro, boundary, gather, sharded.state_attrs, scale_sense, manager,
                      ema, regather, tuple(sharded.units), offload=sharded.offload)
    state.calls, state.real_calls = state_calls(state)
    return state


def _loss_scale(loss_scale: LossScale):
    """``(Parameter, manager Cell or None)`` of a :class:`~mindzero.core.config.LossScale`."""
    manager = loss_scale.manager
    if loss_scale.dynamic is not None:
        manager = nn.DynamicLossScaleUpdateCell(loss_scale.value, *loss_scale.dynamic)
    return Parameter(Tensor(loss_scale.value, ms.float32), name="scale_sense", requires_grad=False), manager


def build_plan(network, optimizer, world: World, config: ZeroConfig) -> PartitionPlan:
    """The partition plan of ``network``'s parameters for this rank, in ``network.get_parameters()`` order
    (dtypes as held: ``param_dtype`` for the optimized parameters of a mixed-precision run)."""
    return PartitionPlan.build(param_infos(network, config.precision, optimizer), world.op_size, world.op_rank,
                               shard_frozen=config.stage3.shard_frozen, **config.persistence)


def _param_states(optimizer, plan: PartitionPlan, config: ZeroConfig) -> tuple:
    """A :class:`ParamState` per optimizer parameter (optimizer order): its plan entry, the entry as its
    gradient is reduced (``reduce_dtype`` with mixed precision) and whether the stage shards it."""
    precision, out = config.precision, []
    for p in optimizer.parameters:
        spec = plan[p.name]
        reduce_in = precision.reduce_in if spec.dtype == "float32" or precision.enabled else None
        reduce_spec = dataclasses.replace(spec, dtype=reduce_in) if reduce_in else spec
        out.append(ParamState(p.name, p, spec, reduce_spec, spec.sharded and config.policy.shard_optimizer_states,
                              weight=p, target=p))
    return tuple(out)


@dataclasses.dataclass
class _Sharded:
    """What :func:`_shard_state` did: the optimizer's state-tuple attribute names, the CRC-32 of every full value
    it computed (for the cross-rank check) and stage 3's gather units (parameter names)."""

    state_attrs: tuple
    digests: dict
    units: list
    offload: object = None


def _shard_state(network, optimizer, config: ZeroConfig, world: World, plan: PartitionPlan, params: tuple) -> _Sharded:
    """Fill each :class:`ParamState`'s weight, target and master: stage 3: network parameters become shards;
    stages 1-2: without ``param_dtype`` each sharded parameter split into this rank's shard (which the optimizer
    updates) and the rest (:mod:`mindzero.engine.split`), with it fp32 master shards, each all-gathered back after
    the update; stages 1-3: the optimizer is re-pointed at
    shards; mixed precision: every optimized parameter gets an fp32 master (its stage 1-2 master shard, else a
    copy of what the network holds), which the optimizer updates, and the network's copy is cast to
    ``param_dtype``. Lazily built Parameters (:func:`mindzero.lazy_init`) are materialised one tensor at a
    time: shards where the stage shards, full values where it keeps them.
    """
    policy, precision = config.policy, config.precision
    specs = {s.name: s for s in plan}
    digests, units = {}, []
    if policy.shard_parameters:
        check_pynative_recompute(network, specs)
        done = shard_network_parameters(network, specs, world, config)
        digests, units = done.digests, done.units
        for ps in params:
            if ps.sharded:  # the network holds the shard now; keep no reference to the full Parameter
                ps.weight = ps.target = done.shards[ps.name]
                ps.param = None
    elif policy.shard_optimizer_states:
        pairs = {}
        if split_layout(config, world):  # fp32: the parameter is its own master, held once (own shard + rest)
            pairs = split_network_parameters(network, specs, [ps.name for ps in params if splittable(ps)], digests)
        for ps in params:
            if ps.sharded and ps.name in pairs:
                own, rest = pairs[ps.name]
                ps.weight = ps.target = own
                ps.master = MasterPair(own, rest, True, split=True)
                ps.param = None
            elif ps.sharded:
                ps.target = make_shard(materialize(ps.param), ps.spec, "zero_master." + ps.name, digests=digests)
                ps.master = MasterPair(ps.target, ps.param, True)
    if precision.enabled:  # the rest held in param_dtype get an fp32 copy, written back locally
        for ps in params:
            if ps.target is ps.weight and ps.spec.dtype == precision.param_dtype:
                materialize(ps.weight, digests if ps.weight is ps.param else None)
                ps.target = Parameter(Tensor(ps.weight.asnumpy(), ms.float32), name="zero_master." + ps.name)
                ps.master = MasterPair(ps.target, ps.weight, False)
    targets = [ps.target for ps in params]
    offload = None
    if config.offload.disk:  # the file first (directory and space checked), then each state written as it is made
        if world.device != "CPU":
            raise ValueError(f"optimizer_offload='disk' runs on CPU only (device {world.device!r}): the streamed "
                             "update shares the parameters' memory with its buffers, which a device's memory is not; "
                             "on GPU/Ascend use optimizer_offload='host' (docs/stages.md)")
        offload = DiskOffload(optimizer, optimizer_states(optimizer),
                              [ps.spec.shard_size if ps.sharded else ps.spec.numel for ps in params], config.offload,
                              world.world_rank)
    if policy.shard_optimizer_states:
        state_attrs = shard_optimizer(optimizer, [ps.spec for ps in params], targets,
                                      keep=offload.keep if offload else None)
    else:
        state_attrs = repoint_optimizer(optimizer, targets) if precision.enabled else optimizer_states(optimizer)
    # what stays full (stage 0, replicated parameters, buffers, step counters)
    for p in network.get_parameters():
        materialize(p, digests if p.name in specs else None)
    for p in optimizer.get_parameters():
        materialize(p)
    if precision.enabled:
        for ps in params:
            if ps.spec.dtype == precision.param_dtype:
                ps.weight.set_dtype(getattr(ms, ps.spec.dtype))
    if offload is not None:
        offload.finish(optimizer, config.gradient_accumulation_steps > 1)
    return _Sharded(tuple(state_attrs), digests, units, offload)


def _accumulation_buffers(config: ZeroConfig, params: tuple) -> None:
    """With ``gradient_accumulation_steps > 1``, each :class:`ParamState`'s buffer: a shard from stage 2
    (sharded parameters), else full; in the dtype gradients are reduced in."""
    if config.gradient_accumulation_steps == 1:
        return
    for ps in params:
        shard = ps.sharded and config.policy.shard_gradients
        shape = (ps.reduce_spec.shard_size,) if shard else tuple(ps.spec.shape)
        dtype = getattr(ms, ps.reduce_spec.dtype)
        ps.accum = Parameter(ops.zeros(shape, dtype), name="zero_accum." + ps.name, requires_grad=False)

"""Assembling a train step's state: the partition plan, one :class:`~mindzero.core.state.ParamState` per
optimized parameter (its shard, master and buffers), the communication buckets, the loss scale and the EMA,
into one :class:`~mindzero.core.state.ZeroState`, made once and complete.
"""
from __future__ import annotations

import dataclasses

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ..core.comm_plan import reduced_whole, state_calls, step_buckets
from ..core.config import LossScale, ZeroConfig
from ..core.introspect import param_infos
from ..core.optim_plan import OWNER, assign_owners, owner_cost, placeholder_shape
from ..core.plan import PartitionPlan
from ..core.state import FULL_MASTER, MASTER_SHARD, STAND_IN, WEIGHT, WIDE_COPY, MasterPair, ParamState, ZeroState, role_of
from ..core.topology import World
from .consistency import check_same_optimizer, check_same_plan, check_same_values
from .materialize import full_array, make_shard, materialize
from .offload import OffloadFile, check_offloadable
from .optim import OptimizerLayout, check_optimizer, offload_update
from .probe import decide_modes, with_owners
from .repoint import PLACEHOLDER_PREFIX, new_states, repoint_optimizer, stand_in
from .stage3 import check_pynative_recompute, shard_network_parameters
from .train_step import ZeroEMA


def assemble(network, optimizer, config: ZeroConfig, world: World) -> ZeroState:
    """The :class:`ZeroState` of ``network`` and ``optimizer`` under ``config`` on this rank of ``world``:
    checks the optimizer and the precision policy, plans, checks the plan across ranks, decides how each
    parameter's update is shared out (flat shards or an owner rank: :mod:`mindzero.core.optim_plan`) and checks
    the optimizer across ranks, shards (network parameters at stage 3, master shards at stages 1-2, the
    optimizer's states from stage 1; lazily built Parameters are materialised one tensor at a time), checks the
    initial values across ranks, and makes the accumulation buffers, the buckets, the loss scale and the EMA.

    Communication: the plan, optimizer and value checks (three small all-gathers).
    """
    policy, precision = config.policy, config.precision
    check_optimizer(optimizer, {p.name: p for p in network.get_parameters()}, policy.shard_optimizer_states,
                    world.device)
    layout = OptimizerLayout.read(optimizer)
    if config.offload.host:
        offload_update(optimizer)
    plan = build_plan(network, optimizer, world, config)
    check_same_plan(plan, world, config.zero_stage)
    params = _param_states(layout, plan, config)
    _decide_updates(layout, params, config, world)
    check_same_optimizer(layout, params, world)
    sharded = _shard_state(network, layout, config, world, plan, params)
    check_same_values(plan, sharded.digests, world)
    _accumulation_buffers(config, params)
    micro, boundary, gather, owner_grads, broadcasts = step_buckets(params, policy, config.fusion, precision.widens)
    scale_sense, manager = _loss_scale(config.loss_scale)
    ema = None
    if config.ema is not None:
        ema = ZeroEMA([ps.weight for ps in params], config.ema.decay, config.ema.updates,
                      ms.float32 if precision.enabled else None)
    regather = config.stage3.for_mode(ms.get_context("mode") == ms.GRAPH_MODE).regather
    state = ZeroState(config, world, plan, params, micro=micro, boundary=boundary, gather=gather,
                      owner_grads=owner_grads, broadcasts=broadcasts, state_attrs=layout.state_attrs,
                      scale_sense=scale_sense, loss_scale_manager=manager, ema=ema, regather=regather,
                      gathers=sharded.gathers, offload=sharded.offload, layout=layout,
                      order=Parameter(Tensor(0, ms.int32), name="zero_collective_order", requires_grad=False))
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
                               shard_frozen=config.stage3.shard_frozen, persistence=config.persistence)


def _param_states(layout: OptimizerLayout, plan: PartitionPlan, config: ZeroConfig) -> tuple:
    """A :class:`ParamState` per optimizer parameter (optimizer order): its plan entry, the entry as its
    gradient is reduced (``reduce_dtype`` with mixed precision) and whether the stage shares it out."""
    precision, out = config.precision, []
    for p in layout.params:
        spec = plan[p.name]
        reduce_in = precision.reduce_in if spec.dtype == "float32" or precision.enabled else None
        reduce_spec = dataclasses.replace(spec, dtype=reduce_in) if reduce_in else spec
        out.append(ParamState(p.name, p, spec, reduce_spec, spec.sharded and config.policy.shard_optimizer_states,
                              weight=p, target=p))
    return tuple(out)


def _decide_updates(layout: OptimizerLayout, params: tuple, config: ZeroConfig, world: World) -> None:
    """Each :class:`ParamState`'s ``update``: flat, owner or whole (:func:`mindzero.engine.probe.decide_modes`),
    owners balanced by the bytes each one holds (:func:`mindzero.core.optim_plan.assign_owners`: states, and the
    full master an owner keeps with ``param_dtype`` or at stage 3)."""
    decided = decide_modes(layout, [ps.spec for ps in params], config.policy.shard_optimizer_states,
                           config.update_sharding)
    keeps_master = config.precision.enabled or config.policy.shard_parameters
    costs = [owner_cost(states, ps.spec.numel * (4 if config.precision.enabled else ps.spec.itemsize)
                        if keeps_master else 0)
             for ps, (mode, _, states) in zip(params, decided) if mode == OWNER]
    for ps, update in zip(params, with_owners(decided, assign_owners(costs, world.op_size))):
        ps.update = update
        ps.all_reduced = reduced_whole(ps, config.policy)


@dataclasses.dataclass
class _Sharded:
    """What :func:`_shard_state` did: the optimizer's state-tuple attribute names, the CRC-32 of every full value
    it computed (for the cross-rank check) and stage 3's weight gathers (:class:`~mindzero.core.units.WeightGather`)."""

    state_attrs: tuple
    digests: dict
    gathers: tuple
    offload: object = None


def _shard_state(network, layout: OptimizerLayout, config: ZeroConfig, world: World, plan: PartitionPlan,
                 params: tuple) -> _Sharded:
    """Fill each :class:`ParamState`'s role (:func:`mindzero.core.state.role_of`, the one table of what the
    optimizer updates), then its weight, target and master as the role names them, then re-point the optimizer
    (:mod:`mindzero.engine.repoint`). At stage 3 the network is sharded first (an owner's full master taken from the
    full value before), and the network's copy of a weight held in ``param_dtype`` is cast last.

    Lazily built Parameters (:func:`mindzero.lazy_init`) are materialised one tensor at a time: shards where the
    stage shards, full values where it keeps them.
    """
    policy, precision = config.policy, config.precision
    specs = {s.name: s for s in plan}
    digests, gathers = {}, ()
    wide = ms.float32 if precision.enabled else None
    op_rank = world.op_rank
    for ps in params:  # the one table (core.state.role_of), then the tensors it names
        ps.role = role_of(policy.shard_parameters, ps.update.mode, ps.update.owned_by(op_rank), precision.enabled,
                          ps.spec.dtype == precision.param_dtype)
    if policy.shard_parameters:
        check_pynative_recompute(network, specs)
        for ps in params:  # an owner's full master, from the full value, before the network holds only shards
            if ps.role.target == FULL_MASTER:
                ps.target = Parameter(Tensor(full_array(ps.param), wide or ps.param.dtype), name="zero_master." + ps.name)
        done = shard_network_parameters(network, specs, world, config)
        digests, gathers = done.digests, done.gathers
        for ps in params:
            if ps.sharded:  # the network holds the shard now; keep no reference to the full Parameter
                ps.weight = done.shards[ps.name]
                ps.param = None
    for ps in params:
        target = ps.role.target
        if target == MASTER_SHARD:
            ps.target = make_shard(materialize(ps.param, digests), ps.spec, "zero_master." + ps.name, digests=digests)
        elif target == FULL_MASTER and not policy.shard_parameters:  # stages 1-2, mixed precision
            ps.target = Parameter(Tensor(full_array(materialize(ps.param, digests)), wide),
                                  name="zero_master." + ps.name)
        elif target == STAND_IN:
            ps.target = stand_in(PLACEHOLDER_PREFIX + ps.name, placeholder_shape(ps.spec.shape, ps.spec.shape),
                                 wide or ps.weight.dtype)
        elif target == WIDE_COPY:
            materialize(ps.weight, digests if ps.weight is ps.param else None)
            ps.target = Parameter(Tensor(ps.weight.asnumpy(), ms.float32), name="zero_master." + ps.name)
        elif target == WEIGHT:
            ps.target = ps.weight
        if ps.role.master is not None:
            ps.master = MasterPair(ps.target, ps.weight, ps.role.master)
    offload = None
    updates = [ps.update for ps in params]
    if config.offload.disk:  # the file first (directory and space checked), then each state written as it is made
        check_offloadable(layout, updates, world.device)
        offload = OffloadFile(layout, [ps.spec.shard_size if ps.sharded else ps.spec.numel for ps in params],
                              config.offload, world.world_rank)
    states = new_states(layout, updates, [ps.spec for ps in params], op_rank, keep=offload.keep if offload else None)
    repoint_optimizer(layout, [ps.target for ps in params], states)
    # what stays full (stage 0, replicated parameters, buffers, step counters)
    for p in network.get_parameters():
        materialize(p, digests if p.name in specs else None)
    for p in layout.optimizer.get_parameters():
        materialize(p)
    if precision.enabled:
        for ps in params:
            if ps.spec.dtype == precision.param_dtype:
                ps.weight.set_dtype(getattr(ms, ps.spec.dtype))
    return _Sharded(layout.state_attrs, digests, gathers, offload)


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

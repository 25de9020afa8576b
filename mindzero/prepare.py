"""``prepare_train_network``: wrap a network and its optimizer into a ZeRO train step.

This module validates the arguments, builds the partition plan and assembles
the per-stage pieces (shards, gradient reducers, optimizer re-pointing); the
step itself is :class:`mindzero.train_step.ZeroTrainOneStepCell`.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import numbers

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from .comm import World, resolve_world
from .config import MixedPrecision, ZeroConfig
from .estimate import param_infos
from .optim import check_optimizer, offload_update, repoint_optimizer, shard_optimizer, state_tuples
from .materialize import materialize
from .plan import PartitionPlan
from .shard import check_pynative_recompute, make_shard, shard_network_parameters
from .comm_plan import format_comm, step_buckets, step_calls
from .layout import COLLECTIVES
from .config import parse_comm_fusion
from .state import MasterPair, ParamState, ZeroState
from .train_step import ZeroEMA, ZeroTrainOneStepCell

logger = logging.getLogger("mindzero")


def _scale_sense(scale_sense):
    """``(Parameter, manager Cell or None)`` from a number, a Tensor or a loss-scale update Cell."""
    if isinstance(scale_sense, nn.Cell):
        if not hasattr(scale_sense, "get_loss_scale"):
            raise ValueError(f"scale_sense must be a number, a Tensor or a loss-scale update Cell with "
                             f"get_loss_scale() (e.g. nn.DynamicLossScaleUpdateCell), got {type(scale_sense).__name__}")
        value, manager = float(scale_sense.get_loss_scale()), scale_sense
    elif isinstance(scale_sense, Tensor):
        if scale_sense.size != 1:
            raise ValueError(f"scale_sense must be a scalar Tensor, got shape {scale_sense.shape}")
        value, manager = float(scale_sense.asnumpy().reshape(())), None
    elif isinstance(scale_sense, numbers.Real) and not isinstance(scale_sense, bool):
        value, manager = float(scale_sense), None
    else:
        raise ValueError(f"scale_sense must be a number, a Tensor or a loss-scale update Cell, got {scale_sense!r}")
    if not value > 0:
        raise ValueError(f"scale_sense must be > 0, got {value}")
    return Parameter(Tensor(value, ms.float32), name="scale_sense", requires_grad=False), manager


def _ema_decay(ema, updates):
    """The EMA decay from ``ema`` (``None``, a number in (0, 1), or mindone's ``EMA`` with ``ema_decay``)."""
    if isinstance(updates, bool) or not isinstance(updates, numbers.Integral) or updates < 0:
        raise ValueError(f"updates (the EMA's initial step count) must be an int >= 0, got {updates!r}")
    if ema is None:
        if updates != 0:
            raise ValueError(f"updates is the EMA's initial step count and needs ema; got updates={updates!r} "
                             "with ema=None")
        return None
    decay = getattr(ema, "ema_decay", ema)
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < decay < 1:
        raise ValueError(f"ema must be None, a decay in (0, 1) or an EMA object with ema_decay in (0, 1) "
                         f"(mindone's EMA), got {ema!r}")
    return float(decay)


def _check_options(optimizer_offload, parallel_modules):
    if not isinstance(optimizer_offload, bool):
        raise ValueError(f"optimizer_offload must be a bool, got {optimizer_offload!r}")
    if parallel_modules is not None:
        raise NotImplementedError("parallel_modules: user-supplied per-layer parallel wrappers are not needed "
                                  "(stage 3 works for any Cell) and not supported; pass None")


def _digits(text: str, n: int) -> list:
    """``n`` 24-bit pieces of a hex digest (exact in float32, the dtype every backend all-gathers)."""
    return [float(int(text[6 * i:6 * i + 6], 16)) for i in range(n)]


def check_same_plan(plan: PartitionPlan, world: World, stage: int) -> None:
    """Fail with a message naming the first difference unless every rank built the same plan and stage.

    Communication: one all-gather of 5 numbers per rank; on a mismatch, one more of one number per
    parameter to locate it. Ranks that disagree would otherwise deadlock in mismatched collectives.

    Raises:
        ValueError: naming this rank, the differing rank and the first differing parameter.
    """
    if world.world_size == 1:
        return
    import hashlib

    import numpy as np

    rows = _rows_of_all_ranks(world, [float(len(plan)), float(stage)] + _digits(plan.fingerprint(), 3))
    bad = [r for r in range(world.world_size) if not np.array_equal(rows[r], rows[0])]
    if not bad:
        return
    other = bad[0]
    if rows[other][1] != rows[0][1]:
        raise ValueError(f"rank {world.world_rank}: zero_stage differs across ranks (rank 0: {int(rows[0][1])}, "
                         f"rank {other}: {int(rows[other][1])}); every rank must prepare the same stage")
    if rows[other][0] != rows[0][0]:
        raise ValueError(f"rank {world.world_rank}: the networks differ across ranks: rank 0 has {int(rows[0][0])} "
                         f"parameters, rank {other} has {int(rows[other][0])}; this rank has {len(plan)}")
    per = [_digits(hashlib.sha256(repr((s.name, s.shape, s.dtype, s.sharded)).encode()).hexdigest(), 1)[0]
           for s in plan]
    table = _rows_of_all_ranks(world, per)
    index = int(np.argmax(table[other] != table[0]))
    spec = plan.specs[index]
    raise ValueError(f"rank {world.world_rank}: the networks differ across ranks at parameter #{index}: on this rank "
                     f"{spec.name!r} {spec.shape} {spec.dtype}, and rank {other} differs from rank 0 there; "
                     "every rank must build the same network and optimizer")


def _rows_of_all_ranks(world: World, row: list):
    """``row`` (floats, exact in float32) from every rank: a ``(world_size, len(row))`` numpy array."""
    import numpy as np

    from .comm import AllGather, shared_cell

    gathered = shared_cell(AllGather, world, "world")(Tensor(np.array(row, np.float32)))
    return gathered.asnumpy().reshape(world.world_size, -1)


def check_same_values(plan: PartitionPlan, digests: dict, world: World) -> None:
    """Fail unless every rank computed the same full values (``digests``: name -> CRC32 of the full
    tensor, for the tensors prepare materialised or sharded).

    Communication: one all-gather of two numbers per parameter. Ranks built with different seeds would
    otherwise train different replicas (stages 0-2) or a model stitched from different initialisations.

    Raises:
        ValueError: naming the first parameter whose values differ and the rank.
    """
    if world.world_size == 1:
        return
    import numpy as np

    row = []
    for s in plan:
        crc = digests.get(s.name, -1)
        row += [-1.0, -1.0] if crc < 0 else [float(crc >> 16), float(crc & 0xFFFF)]  # exact in float32
    table = _rows_of_all_ranks(world, row)
    bad = [r for r in range(world.world_size) if not np.array_equal(table[r], table[0])]
    if bad:
        index = int(np.argmax(np.any(table[bad[0]].reshape(-1, 2) != table[0].reshape(-1, 2), axis=1)))
        raise ValueError(f"rank {world.world_rank}: the initial values of parameter {plan.specs[index].name!r} differ "
                         f"between rank 0 and rank {bad[0]}; every rank must build the same network with the same "
                         "seed (call mindspore.set_seed(...) with one value on every rank before building it)")


def build_plan(network, optimizer, world: World, precision: MixedPrecision = MixedPrecision()) -> PartitionPlan:
    """The partition plan of ``network``'s parameters for this rank, in ``network.get_parameters()`` order
    (dtypes as held: ``param_dtype`` for the optimized parameters of a mixed-precision run)."""
    return PartitionPlan.build(param_infos(network, precision, optimizer), world.op_size, world.op_rank)


def prepare_train_network(network, optimizer, scale_sense=1.0, ema=None, updates=0, drop_overflow_update=True,
                          gradient_accumulation_steps=1, clip_grad=False, clip_norm=1.0, verbose=False,
                          zero_stage=0, optimizer_offload=False, optimizer_parallel_group=None, dp_group=None,
                          comm_fusion=None, parallel_modules=None, stage3_regather=True, param_dtype=None,
                          reduce_dtype=None, config=None):
    """Wrap ``network`` (which returns the loss) and ``optimizer`` into a ZeRO train step.

    Must be called on all ranks, with the same network and optimizer structure,
    after ``mindspore.communication.init()`` (or without it, for one process).

    Args:
        network: a Cell returning a scalar loss.
        optimizer: a ``mindspore.nn.Optimizer`` over (a subset of) ``network``'s parameters.
            From stage 1 on it is re-pointed at shard Parameters in place; do not reuse it elsewhere.
        scale_sense: loss scale: a number, a scalar Tensor, or ``nn.DynamicLossScaleUpdateCell``.
        drop_overflow_update: skip the update on all ranks when any rank's gradients overflow.
        gradient_accumulation_steps: micro-batches per update (each call is one micro-batch).
        clip_grad, clip_norm: clip by the global norm over all shards.
        verbose: log the partition plan on rank 0.
        zero_stage: 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
        optimizer_parallel_group, dp_group: ``None`` (or the world group) to shard over the whole world;
            or, for hybrid sharding, the name of this rank's op group (the ranks it shards with) and of its
            dp group (the ranks holding the same shard in the other op groups); see
            :func:`mindzero.create_hybrid_groups` and docs/hybrid.md.
        comm_fusion: ``None``, or mindone's dict ``{"allreduce" | "reduce_scatter" | "allgather":
            {"openstate": bool, "bucket_size": bytes}}``: consecutive tensors share one collective up to
            ``bucket_size`` bytes (full-tensor bytes) per bucket; results equal fusion off (docs/performance.md).
        stage3_regather: stage 3, graph mode: all-gather each parameter again in backward instead of
            keeping its full value alive from forward (peak gathered-parameter memory about the largest
            layer's, at one more all-gather per parameter); ``False`` trades that memory for speed.
        optimizer_offload: run the optimizer's update primitive (and so keep its states) on the host;
            see :func:`mindzero.optim.offload_update` (on CPU: the same result, nothing moves).
        ema: ``None``; a decay in (0, 1); or mindone's ``EMA`` (its ``ema_decay`` is used): keep an
            exponential moving average of the optimized parameters, held like them (shards at stage 3),
            updated after each applied step; ``updates``: its initial step count (decay warm-up).
            Read it with ``gather_full_state_dict(train_net, ema=True)``; checkpoints save it.
        param_dtype: ``None`` (default: parameters trained in their own dtype), ``ms.float16`` or
            ``ms.bfloat16`` (or the name): mixed precision: the network holds its optimized parameters in
            this dtype (full at stages 0-2, shards at stage 3; gathered in it at stages 1-3) and the
            optimizer updates fp32 master values (full at stage 0, shards from stage 1) that are cast back
            after each update. The network must compute in this dtype where it reads them
            (``to_float`` / ``mindspore.amp.auto_mixed_precision(net, "O2")``); Cells marked
            ``to_float(ms.float32)`` (LayerNorm, BatchNorm) get fp32 copies. Memory: the ZeRO paper's
            16Φ, 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N. See docs/stages.md.
        reduce_dtype: with ``param_dtype``: the dtype gradients are reduced and accumulated in: ``None``
            (= ``param_dtype``, half the bytes of fp32) or ``ms.float32``; the optimizer gets fp32.
        parallel_modules: mindone's argument; not needed (stage 3 works for any Cell): a value raises
            ``NotImplementedError``.
        config: a settings file (YAML path) or mapping (:func:`mindzero.load_config`) holding any of the
            arguments above that a file can hold; ``hybrid_shard_size: G`` there creates the hybrid groups
            (:func:`mindzero.create_hybrid_groups`). An argument also given here with a value other than its
            default is an error (naming both values): one source per setting.

    Returns:
        :class:`ZeroTrainOneStepCell`; ``loss, overflow, scale = train_net(*inputs)``.

    Raises:
        ValueError / TypeError: bad arguments (the message names the argument, value and rule).
    """
    if config is not None:
        given = {k: v for k, v in locals().items() if k not in ("network", "optimizer", "config")}
        return prepare_train_network(network, optimizer, **_from_settings(config, given))
    config = ZeroConfig(zero_stage, gradient_accumulation_steps, clip_grad, clip_norm, drop_overflow_update, verbose,
                        MixedPrecision.parse(param_dtype, reduce_dtype))
    if not isinstance(stage3_regather, bool):
        raise ValueError(f"stage3_regather must be a bool, got {stage3_regather!r}")
    if not isinstance(network, nn.Cell):
        raise TypeError(f"network must be a mindspore.nn.Cell, got {type(network).__name__}")
    train_net = _build(network, optimizer, config, _Options(scale_sense, ema, updates, optimizer_offload,
                                                            optimizer_parallel_group, dp_group, comm_fusion,
                                                            parallel_modules, stage3_regather))
    # the replaced full tensors (parameters at stage 3, optimizer states from stage 1) sit in reference
    # cycles of MindSpore objects: collect them now (measured: 380 MiB on a 105M GPT at stage 3), not
    # whenever the cyclic collector next runs; prepare's own references are gone by here
    gc.collect()
    if verbose and train_net.zero_info.world.world_rank == 0:
        logger.warning("%s", plan_text(train_net))
    return train_net


def _from_settings(config, given: dict) -> dict:
    """The keyword arguments of ``prepare_train_network`` from a settings file or mapping plus the
    arguments given directly (``given``: every argument's value); a setting in both is refused."""
    import inspect

    from .settings import resolve_settings

    settings = resolve_settings(config)
    defaults = {k: p.default for k, p in inspect.signature(prepare_train_network).parameters.items()}
    explicit = {k: v for k, v in given.items() if not (type(v) is type(defaults[k]) and v == defaults[k])}
    kwargs = {k: v for k, v in settings.items() if k != "checkpoint"}
    shard_size = kwargs.pop("hybrid_shard_size", None)
    both = sorted(set(kwargs) & set(explicit))
    if shard_size is not None:
        both += [k for k in ("optimizer_parallel_group", "dp_group") if k in explicit]
    if both:
        k = both[0]
        raise ValueError(f"{k} is given both as an argument ({explicit[k]!r}) and in config "
                         f"({kwargs.get(k, f'hybrid_shard_size={shard_size}')!r}); give each setting once")
    if isinstance(kwargs.get("scale_sense"), dict):
        s = kwargs["scale_sense"]
        kwargs["scale_sense"] = nn.DynamicLossScaleUpdateCell(s["init_loss_scale"], s["scale_factor"],
                                                              s["scale_window"])
    if shard_size is not None:
        from .comm import create_hybrid_groups, current_world

        if shard_size != current_world().world_size:  # the whole world is no hybrid layout
            kwargs["optimizer_parallel_group"], kwargs["dp_group"] = create_hybrid_groups(shard_size)
    return {**given, **kwargs}


@dataclasses.dataclass(frozen=True)
class _Options:
    """The arguments of ``prepare_train_network`` that are not the network, the optimizer or the
    :class:`ZeroConfig`."""

    scale_sense: object
    ema: object
    updates: int
    optimizer_offload: bool
    optimizer_parallel_group: object
    dp_group: object
    comm_fusion: object
    parallel_modules: object
    stage3_regather: bool


def _build(network, optimizer, config: ZeroConfig, options: _Options):
    fusion = parse_comm_fusion(options.comm_fusion)
    world = resolve_world(options.optimizer_parallel_group, options.dp_group)
    _check_options(options.optimizer_offload, options.parallel_modules)
    ema_decay = _ema_decay(options.ema, options.updates)
    policy, precision = config.policy, config.precision
    check_optimizer(optimizer, {p.name: p for p in network.get_parameters()}, policy.shard_optimizer_states)
    check_precision(precision, optimizer, world)
    scale_param, manager = _scale_sense(options.scale_sense)
    if options.optimizer_offload:
        offload_update(optimizer)
    plan = build_plan(network, optimizer, world, precision)
    check_same_plan(plan, world, config.zero_stage)
    regather = options.stage3_regather and ms.get_context("mode") == ms.GRAPH_MODE
    state = ZeroState(config, world, plan, fusion, _param_states(optimizer, plan, config), regather=regather,
                      scale_sense=scale_param, loss_scale_manager=manager)
    state.micro, state.boundary, state.gather = step_buckets(state.params, policy, fusion)
    digests = {}
    state.state_attrs = _shard_state(network, optimizer, state, options.stage3_regather, digests)
    check_same_values(plan, digests, world)
    _accumulation_buffers(state)
    if ema_decay is not None:
        state.ema = ZeroEMA(state.weights, ema_decay, options.updates, ms.float32 if precision.enabled else None)
    train_net = ZeroTrainOneStepCell(network, optimizer, state)
    state.calls = tuple(step_calls(state, world))
    state.real_calls = tuple(step_calls(state, world.with_backend(COLLECTIVES))) if world.emulated else state.calls
    train_net.zero_info = state
    return train_net


def _param_states(optimizer, plan: PartitionPlan, config: ZeroConfig) -> tuple:
    """A :class:`ParamState` per optimizer parameter (optimizer order): its plan entry, the entry as its
    gradient is reduced (``reduce_dtype`` with mixed precision) and whether the stage shards it."""
    precision, out = config.precision, []
    for p in optimizer.parameters:
        spec = plan[p.name]
        reduce_spec = dataclasses.replace(spec, dtype=precision.reduce_dtype) if precision.enabled else spec
        out.append(ParamState(p.name, p, spec, reduce_spec, spec.sharded and config.policy.shard_optimizer_states,
                              weight=p, target=p))
    return tuple(out)


def check_precision(precision: MixedPrecision, optimizer, world: World) -> None:
    """Refuse a mixed-precision policy this run cannot honour.

    Raises:
        ValueError: bfloat16 on CPU (MindSpore 2.10 has no bfloat16 Dense/MatMul kernels there), or an
            optimized parameter that is not float32 (its fp32 master and states come from it).
    """
    if not precision.enabled:
        return
    if precision.param_dtype == "bfloat16" and world.device == "CPU":
        raise ValueError("param_dtype=bfloat16 is not supported on CPU: MindSpore 2.10 has no bfloat16 kernels for "
                         "Dense/MatMul there; use param_dtype=float16 on CPU (bfloat16 on GPU/Ascend)")
    for p in optimizer.parameters:
        if str(p.dtype).lower() != "float32":
            raise ValueError(f"param_dtype={precision.param_dtype} needs the optimizer's parameters in float32 "
                             f"(mindzero makes the {precision.param_dtype} copies and keeps the fp32 masters); "
                             f"parameter {p.name!r} is {str(p.dtype).lower()}: build the network in float32")


def plan_text(train_net) -> str:
    """The verbose log of ``prepare_train_network``: stage, groups, per-rank bytes by kind next to the
    formula, replicated parameters with reasons, and the communication per step."""
    from .memory import memory_report

    info = train_net.zero_info
    world, config = info.world, info.config
    groups = (f"op group {world.op_size} ({world.op_group!r}) x {world.dp_size} replicas "
              f"(dp group {world.dp_group!r})" if world.hybrid else f"op group {world.op_size} (the world)")
    fusion = ", ".join(f"{k} {info.fusion.bucket_bytes(k) / 2 ** 20:g} MiB" for k in ("allreduce", "reduce_scatter",
                                                                                      "allgather")
                       if info.fusion.bucket_bytes(k) is not None) or "off"
    report = memory_report(train_net)
    mib = 2 ** 20
    lines = [f"mindzero: zero_stage={config.zero_stage}, {groups}, device {world.device}, "
             f"gradient_accumulation_steps={config.gradient_accumulation_steps}, comm_fusion: {fusion}"]
    if info.precision.enabled:
        lines.append(f"mixed precision: parameters {info.precision.param_dtype}, gradients reduced in "
                     f"{info.precision.reduce_dtype}, fp32 masters and optimizer states")
    lines.append("persistent bytes per rank (measured = plan):")
    for kind in ("parameters", "gradients", "optimizer_states"):
        lines.append(f"  {kind:<17} {report[kind] / mib:10.3f} MiB (plan {report['expected'][kind] / mib:.3f} MiB)")
    lines.append(info.plan.summary())
    lines.append(format_comm(info.calls, info.real_calls if world.emulated else None))
    return "\n".join(lines)


def _shard_state(network, optimizer, state: ZeroState, regather: bool, digests: dict) -> tuple:
    """Fill each :class:`ParamState`'s weight, target and master: stage 3: network parameters become shards;
    stages 1-2: master shards, all-gathered back after the update; stages 1-3: the optimizer is re-pointed at
    shards; mixed precision: every optimized parameter gets an fp32 master (its stage 1-2 master shard, else a
    copy of what the network holds), which the optimizer updates, and the network's copy is cast to
    ``param_dtype``. Lazily built Parameters (:func:`mindzero.lazy_init`) are materialised one tensor at a
    time: shards where the stage shards, full values where it keeps them; ``digests`` receives the CRC32 of
    every full value computed.

    Returns:
        the optimizer's state-tuple attribute names.
    """
    policy, precision, world = state.config.policy, state.config.precision, state.world
    specs = {s.name: s for s in state.plan}
    if policy.shard_parameters:
        check_pynative_recompute(network, specs)
        shards = shard_network_parameters(network, specs, world, regather, digests, precision.reduce_dtype)
        for ps in state.params:
            if ps.sharded:  # the network holds the shard now; keep no reference to the full Parameter
                ps.weight = ps.target = shards[ps.name]
                ps.param = None
    elif policy.shard_optimizer_states:
        for ps in state.params:
            if ps.sharded:
                ps.target = make_shard(materialize(ps.param), ps.spec, "zero_master." + ps.name, digests=digests)
                ps.master = MasterPair(ps.target, ps.param, True)
    if precision.enabled:  # the rest held in param_dtype get an fp32 copy, written back locally
        for ps in state.params:
            if ps.target is ps.weight and ps.spec.dtype == precision.param_dtype:
                materialize(ps.weight, digests if ps.weight is ps.param else None)
                ps.target = Parameter(Tensor(ps.weight.asnumpy(), ms.float32), name="zero_master." + ps.name)
                ps.master = MasterPair(ps.target, ps.weight, False)
    targets = [ps.target for ps in state.params]
    if policy.shard_optimizer_states:
        state_attrs = shard_optimizer(optimizer, [ps.spec for ps in state.params], targets)
    else:
        state_attrs = repoint_optimizer(optimizer, targets) if precision.enabled else tuple(state_tuples(optimizer))
    # what stays full (stage 0, replicated parameters, buffers, step counters)
    for p in network.get_parameters():
        materialize(p, digests if p.name in specs else None)
    for p in optimizer.get_parameters():
        materialize(p)
    if precision.enabled:
        for ps in state.params:
            if ps.spec.dtype == precision.param_dtype:
                ps.weight.set_dtype(getattr(ms, ps.spec.dtype))
    return tuple(state_attrs)


def _accumulation_buffers(state: ZeroState) -> None:
    """With ``gradient_accumulation_steps > 1``, each :class:`ParamState`'s buffer: a shard from stage 2
    (sharded parameters), else full; in ``reduce_dtype`` with mixed precision."""
    config = state.config
    if config.gradient_accumulation_steps == 1:
        return
    for ps in state.params:
        shard = ps.sharded and config.policy.shard_gradients
        shape = (ps.reduce_spec.shard_size,) if shard else tuple(ps.spec.shape)
        dtype = getattr(ms, ps.reduce_spec.dtype) if config.precision.enabled else ps.weight.dtype
        ps.accum = Parameter(ops.zeros(shape, dtype), name="zero_accum." + ps.name, requires_grad=False)


"""The collectives of one training step, before step 1 (pure Python, no MindSpore import).

:func:`step_calls` lists every collective a rank issues in one optimizer step (``K``
micro-steps), in the order the train step issues them, from the partition plan, the
stage, the world (its groups and backend) and ``comm_fusion``. The train step builds its reducers and gathers
from the same :func:`step_buckets`, and stage 3's weight gathers from the same records
(:class:`~mindzero.core.units.WeightGather`, ``ZeroState.gathers``), so the list is what runs;
``tests/multirank`` counts the collectives actually called (PyNative) and compares.

Sizes: ``nbytes`` is the full tensor of the call (an all-reduce's or reduce-scatter's
input, an all-gather's output). ``traffic`` is what a ring algorithm sends per rank:
all-reduce ``2 (n-1)/n x nbytes``, reduce-scatter, all-gather and broadcast ``(n-1)/n x nbytes``
(the ZeRO paper's accounting: stage 0 moves 2Φ, stages 1-2 2Φ, stage 3 3Φ; an owner-mode parameter adds a
broadcast of its value at stages 1-2, and the all-gather of its gradient and that broadcast at stage 3).

On CPU (``emulated``) a reduce-scatter is an all-reduce over the world of the unpadded
tensor (twice a real reduce-scatter's traffic), and a hybrid op-group all-gather is a
world all-gather (``R`` times the bytes); :func:`emulation_extra` reports the difference.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import FusionConfig, StagePolicy
from .plan import REASON_PERSISTENT
from .quant import block_for, payload_bytes
from .topology import COLLECTIVES, World
from .units import Read, weight_gathers
from .optim_plan import FLAT, OWNER
from .state import ALL_GATHER, ALL_REDUCE, BROADCAST_FROM, REDUCE_SCATTER, CommBucket, ParamState, ZeroState

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# stage 3's persistent parameters (below stage3_param_persistence_threshold) are all-reduced together in buckets of
# this many bytes when comm_fusion sets no allreduce bucket: small tensors, one call where there were one each
PERSISTENT_BUCKET_BYTES = 32 * 2 ** 20
# owner mode's collectives travel in buckets of at most this many bytes of full tensors (comm_fusion's allgather
# bucket where it sets one): the gradients all-gathered to their owners (one collective per bucket, not per
# parameter) and each owner's updated parameters broadcast (a bucket is concatenated on the owner and received
# whole on the others, so one bucket of everything an owner holds would put 2-3 copies of 1/N of the model on
# every rank at once)
OWNER_BUCKET_BYTES = 16 * 2 ** 20


@dataclass(frozen=True)
class Call:
    op: str  # one of OPS
    phase: str  # forward, backward (micro-steps), boundary, update (once per optimizer step)
    ranks: int  # participants
    nbytes: int  # the full tensor (all-reduce / reduce-scatter input, all-gather output)
    tensors: int = 1  # parameters carried (more than one in a fused bucket)

    @property
    def traffic(self) -> float:
        if self.ranks <= 1:
            return 0.0
        share = (self.ranks - 1) / self.ranks * self.nbytes
        return 2 * share if self.op == "all_reduce" else share


def buckets(nbytes, keys, bucket_bytes) -> list:
    """Consecutive groups of positions ``0..len(nbytes)-1``: a new bucket starts when the next tensor
    would push the bucket past ``bucket_bytes`` or has another ``key`` (dtype). ``bucket_bytes=None``:
    one tensor per bucket. A tensor larger than the bucket travels alone."""
    out, current, size = [], [], 0
    for i, (b, key) in enumerate(zip(nbytes, keys)):
        if current and (bucket_bytes is None or size + b > bucket_bytes or keys[current[0]] != key):
            out.append(tuple(current))
            current, size = [], 0
        current.append(i)
        size += b
    if current:
        out.append(tuple(current))
    return out


def spec_buckets(specs, bucket_bytes) -> list:
    """:func:`buckets` of ``specs`` (full-tensor bytes, dtype) of at most ``bucket_bytes`` (``None``: one each)."""
    return buckets([s.numel * s.itemsize for s in specs], [s.dtype for s in specs], bucket_bytes)


def reduce_scatter_calls(specs, world: World, phase: str) -> list:
    """One fused reduce-scatter (sum over the world, shard over the op group) of ``specs``."""
    if world.world_size == 1:
        return []
    if world.emulated:
        return [Call("all_reduce", phase, world.world_size, sum(s.numel * s.itemsize for s in specs), len(specs))]
    calls = [Call("reduce_scatter", phase, world.op_size, sum(s.padded_numel * s.itemsize for s in specs),
                  len(specs))]
    if world.dp_size > 1:
        calls.append(Call("all_reduce", phase, world.dp_size, sum(s.shard_size * s.itemsize for s in specs),
                          len(specs)))
    return calls


def gathered_bytes(spec, quant_block=None) -> int:
    """Bytes one rank sends in a gather of ``spec``'s shard: the shard, or with ``quant_block`` (stage 3's quantized
    gathers, :mod:`mindzero.core.quant`) its int8 values and an fp32 scale per block."""
    if quant_block is not None:
        return payload_bytes(spec.shard_size, quant_block)
    return spec.shard_size * spec.itemsize


def all_gather_calls(specs, world: World, phase: str, quant_block=None) -> list:
    """One fused all-gather of ``specs``' shards over the op group (``quant_block``: stage 3's quantized gather of
    a :class:`~mindzero.core.units.WeightGather`)."""
    if world.op_size == 1:
        return []
    ranks = world.world_size if world.emulated else world.op_size
    return [Call("all_gather", phase, ranks, sum(gathered_bytes(s, quant_block) for s in specs) * ranks, len(specs))]


def broadcast_calls(specs, world: World, phase: str) -> list:
    """One broadcast of ``specs``' full tensors from their owner to its op group (hybrid: CPU all-gathers over the
    world and keeps the owner's row; GPU/Ascend all-reduce the owner's values with the others' zeros)."""
    if world.op_size == 1:
        return []
    nbytes = sum(s.numel * s.itemsize for s in specs)
    if not world.hybrid:
        return [Call("broadcast", phase, world.world_size, nbytes, len(specs))]
    if world.emulated:
        return [Call("all_gather", phase, world.world_size, nbytes * world.world_size, len(specs))]
    return [Call("all_reduce", phase, world.op_size, nbytes, len(specs))]


def all_reduce_calls(specs, world: World, phase: str) -> list:
    """One fused all-reduce (sum over the world) of ``specs``' full gradients."""
    if world.world_size == 1:
        return []
    return [Call("all_reduce", phase, world.world_size, sum(s.numel * s.itemsize for s in specs), len(specs))]


def reduced_whole(param: ParamState, policy: StagePolicy) -> bool:
    """Whether ``param``'s gradient is all-reduced whole though the stage shares its update out: an owner-mode
    parameter at stage 1, where every rank holds full gradients anyway. Its owner updates from the full sum; the
    all-reduce moves what a reduce-scatter and the all-gather to the owner would (on CPU, where a reduce-scatter is
    an all-reduce and a slice, half of it), and holds no second full gradient."""
    return (param.sharded and _mode(param) == OWNER and policy.shard_optimizer_states
            and not policy.shard_gradients)


def step_buckets(params, policy: StagePolicy, fusion: FusionConfig, widens: bool = False) -> tuple:
    """``(micro, boundary, gather, owner_grads, broadcasts)``: the :class:`~mindzero.core.state.CommBucket` tuples
    of one step, the one statement of which collective moves which tensor at each stage (the train step builds its
    reductions from them, :func:`step_calls` counts them).

    ``params``: :class:`~mindzero.core.state.ParamState` per optimized parameter (optimizer order), each with its
    ``update`` (:mod:`mindzero.core.optim_plan`). Stage 2 reduce-scatters the sharded gradients every micro-step,
    stage 1 at the accumulation boundary; stage 3 reduce-scatters each where it is read
    (:class:`mindzero.engine.stage3.GatherFull`, no bucket); every stage all-reduces the rest (stage 0: every
    gradient) at the boundary, stage 3's persistent parameters in fused buckets whatever ``comm_fusion`` says
    (:data:`PERSISTENT_BUCKET_BYTES`). Then the update: stages 1-2 all-gather the updated flat master shards;
    an owner-mode parameter's gradient is all-reduced whole at stage 1 (:func:`reduced_whole`), its reduced
    gradient shard all-gathered at stages 2-3 (its owner updates it whole: ``widens``, the gradients are fp32 by
    then; in buckets per dtype of at most :data:`OWNER_BUCKET_BYTES`), and its updated value broadcast from its
    owner, in buckets per owner and dtype of at most :data:`OWNER_BUCKET_BYTES` (at stage 3 every rank keeps its
    shard of it). The other buckets follow
    ``comm_fusion`` (one tensor each without it).
    """
    def units(positions, kind, fusion_kind, held=False, bucket_bytes=None):
        specs = [params[i].spec if held else params[i].reduce_spec for i in positions]
        size = fusion.bucket_bytes(fusion_kind) if bucket_bytes is None else bucket_bytes
        return tuple(CommBucket(tuple(positions[j] for j in b), kind, tuple(specs[j] for j in b))
                     for b in spec_buckets(specs, size))

    whole = [i for i, p in enumerate(params) if reduced_whole(p, policy)]
    sharded = [i for i, p in enumerate(params) if p.sharded and i not in whole]
    master_shards = policy.shard_optimizer_states and not policy.shard_parameters  # stages 1-2
    micro, boundary, gather = (), (), ()
    if master_shards and policy.shard_gradients:
        micro = units(sharded, REDUCE_SCATTER, "reduce_scatter")
    elif master_shards:
        boundary = units(sharded, REDUCE_SCATTER, "reduce_scatter")
    boundary += units(whole, ALL_REDUCE, "allreduce")
    replicated = [i for i, p in enumerate(params) if not p.sharded]
    persistent = [i for i in replicated if params[i].spec.reason == REASON_PERSISTENT]
    boundary += units([i for i in replicated if params[i].spec.reason != REASON_PERSISTENT], ALL_REDUCE, "allreduce")
    boundary += units(persistent, ALL_REDUCE, "allreduce",
                      bucket_bytes=fusion.bucket_bytes("allreduce") or PERSISTENT_BUCKET_BYTES)
    if master_shards:
        gather = units([i for i in sharded if _mode(params[i]) == FLAT], ALL_GATHER, "allgather", held=True)
    owned = [i for i, p in enumerate(params) if p.sharded and _mode(p) == OWNER]
    size = fusion.bucket_bytes("allgather") or OWNER_BUCKET_BYTES
    gathered = [i for i in owned if i not in whole]
    specs = [replace(params[i].reduce_spec, dtype="float32") if widens else params[i].reduce_spec for i in gathered]
    owner_grads = tuple(CommBucket(tuple(gathered[j] for j in b), ALL_GATHER, tuple(specs[j] for j in b))
                        for b in spec_buckets(specs, size))
    broadcasts = []
    for root in sorted({params[i].update.owner for i in owned}):
        mine = [i for i in owned if params[i].update.owner == root]
        for dtype in dict.fromkeys(params[i].spec.dtype for i in mine):
            same = [i for i in mine if params[i].spec.dtype == dtype]
            broadcasts += [CommBucket(tuple(same[j] for j in b), BROADCAST_FROM, tuple(params[same[j]].spec for j in b),
                                      root) for b in spec_buckets([params[i].spec for i in same], size)]
    return micro, boundary, gather, owner_grads, tuple(broadcasts)


def _mode(param: ParamState) -> str:
    """A parameter's update mode (flat where no update was decided: the plans of the unit tests and the benchmark's
    plain-DP accounting)."""
    return FLAT if param.update is None else param.update.mode


def state_calls(state) -> tuple:
    """``(calls, real_calls)`` of ``state``: :func:`step_calls` as its world runs them, and with real
    reduce-scatter and sub-group collectives (what GPU/Ascend run; the same tuple where the world has them)."""
    calls = tuple(step_calls(state, state.world))
    if not state.world.emulated:
        return calls, calls
    return calls, tuple(step_calls(state, state.world.with_backend(COLLECTIVES)))


def step_calls(state, world: World) -> list:
    """Every collective of one optimizer step of ``state`` (a :class:`~mindzero.core.state.ZeroState`: its
    parameters, buckets and config), in issue order, as ``world`` (its groups and backend) runs them."""
    config = state.config
    micro, boundary, update = [], [], []
    if config.policy.shard_parameters:
        # one all-gather per weight gather the network runs (state.gathers: a unit's parameters share one, where
        # its first member is read, and with regather one in backward where its last member's gradient is reduced)
        sharded = [p for p in state.params if p.sharded]
        by_name = {s.name: s for s in state.plan} if state.plan is not None else {p.name: p.spec for p in sharded}
        gather_of = {name: g for g in state.gathers for name in g.names}

        def gathers(name, phase, done):
            g = gather_of.get(name)
            if g is None or g in done:  # not read by the network, or its unit gathered already
                return []
            done.add(g)
            return all_gather_calls([by_name[n] for n in g.names], world, phase, g.quant_block)

        forward, backward = set(), set()
        for g in state.gathers:
            micro += gathers(g.names[0], "forward", forward)
        for p in reversed(sharded):
            if state.regather:
                micro += gathers(p.name, "backward", backward)
            micro += reduce_scatter_calls([p.reduce_spec], world, "backward")
        # a frozen weight has no gradient to reduce; backward gathers it again where the gradient of its
        # layer's input is needed (every frozen layer above the lowest trainable one): at most once each
        if state.regather:
            frozen = [s for s in state.plan if s.frozen] if state.plan is not None else []
            micro += [c for s in frozen for c in gathers(s.name, "backward", backward)]
    for b in state.micro:
        micro += reduce_scatter_calls(b.specs, world, "backward")
    for b in state.boundary:
        boundary += (reduce_scatter_calls if b.kind == REDUCE_SCATTER else all_reduce_calls)(b.specs, world, "boundary")
    if world.world_size > 1:
        boundary.append(Call("all_reduce", "boundary", world.world_size, 4))  # the overflow flag
    if config.clip_grad and any(p.spec.sharded for p in state.params) and world.op_size > 1:
        emulate = world.emulated and world.dp_size > 1
        boundary.append(Call("all_reduce", "boundary", world.world_size if emulate else world.op_size,
                             4 * (world.dp_size if emulate else 1)))
    for b in state.gather:
        update += all_gather_calls(b.specs, world, "update")
    for b in state.owner_grads:
        update += all_gather_calls(b.specs, world, "update")
    for b in state.broadcasts:
        update += broadcast_calls(b.specs, world, "update")
    return micro * config.gradient_accumulation_steps + boundary + update


def plan_state(specs, config, fusion: FusionConfig = FusionConfig(), regather: bool = True, reduce_specs=None):
    """A :class:`~mindzero.core.state.ZeroState` of ``specs`` (the optimizer's parameters' plan entries, held
    dtype) under ``config`` (a :class:`~mindzero.core.config.ZeroConfig`), with its buckets, without MindSpore:
    what :func:`step_calls` needs, for the unit tests and the benchmark's plain-DP accounting
    (``prepare_train_network`` fills the same records with the real tensors)."""
    policy = config.policy
    reduce_specs = specs if reduce_specs is None else reduce_specs
    params = tuple(ParamState(s.name, None, s, r, s.sharded and policy.shard_optimizer_states)
                   for s, r in zip(specs, reduce_specs))
    micro, boundary, gather, owner_grads, broadcasts = step_buckets(params, policy, fusion)
    gathers = ()
    if policy.shard_parameters:  # one weight gather per sharded parameter, as a network reading each once (no units)
        quant, by_name = config.stage3.quantization, {s.name: s for s in specs}
        gathers = weight_gathers([Read(s.name, "", s.numel * s.itemsize, None) for s in specs if s.sharded], None,
                                 lambda name: block_for(quant, name, by_name[name].shape))
    config = replace(config, fusion=fusion)
    return ZeroState(config, None, None, params, micro, boundary, gather, regather=regather, owner_grads=owner_grads,
                     broadcasts=broadcasts, gathers=gathers)


def summarize(calls) -> dict:
    """``{op: {"calls", "bytes", "traffic"}}`` plus ``"total"``, for a list of :class:`Call`."""
    out = {op: {"calls": 0, "bytes": 0, "traffic": 0.0} for op in OPS}
    for c in calls:
        row = out[c.op]
        row["calls"] += 1
        row["bytes"] += c.nbytes
        row["traffic"] += c.traffic
    out["total"] = {k: sum(out[op][k] for op in OPS) for k in ("calls", "bytes", "traffic")}
    return out


def emulation_extra(calls_emulated, calls_real) -> float:
    """Ring traffic per rank the CPU emulation adds over the real collectives (bytes per step)."""
    return summarize(calls_emulated)["total"]["traffic"] - summarize(calls_real)["total"]["traffic"]


def format_comm(calls, real_calls=None) -> str:
    """Lines for the verbose plan log: per collective kind, calls, bytes and ring traffic per step."""
    mib = 2 ** 20
    s = summarize(calls)
    lines = ["communication per optimizer step and rank (ring traffic = bytes each rank sends):"]
    for op in OPS:
        r = s[op]
        if r["calls"]:
            lines.append(f"  {op:<15} {r['calls']:>5} calls  {r['bytes'] / mib:10.3f} MiB  "
                         f"traffic {r['traffic'] / mib:10.3f} MiB")
    t = s["total"]
    lines.append(f"  {'total':<15} {t['calls']:>5} calls  {t['bytes'] / mib:10.3f} MiB  "
                 f"traffic {t['traffic'] / mib:10.3f} MiB")
    if real_calls is not None:
        extra = emulation_extra(calls, real_calls)
        lines.append(f"  CPU emulation (all-reduce for reduce-scatter, world for sub-group collectives) adds "
                     f"{extra / mib:.3f} MiB of traffic over real collectives "
                     f"({summarize(real_calls)['total']['traffic'] / mib:.3f} MiB)")
    return "\n".join(lines)

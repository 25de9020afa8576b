"""What a built train step holds and does: :func:`memory_report` (bytes counted from the tensors a rank
holds, next to the plan's) and :func:`plan_text` (the verbose log of ``prepare_train_network``)."""
from __future__ import annotations

from ..core.comm_plan import all_gather_calls, broadcast_calls, format_comm, summarize
from ..core.estimate import both_formulas
from ..core.memory import expected_bytes
from ..core.optim_plan import OWNER, balance, every_rank_bytes
from .offload import splits_parameters
from .states import nbytes


def memory_report(train_net) -> dict:
    """Bytes this rank holds persistently, counted from the tensors actually allocated.

    Returns:
        ``{"parameters", "gradients", "optimizer_states", "optimizer_moments", "master_shards", "ema": int,
        "expected": {same keys}, "stage": int, "device": str, "backend": str, "collectives": {operation: {"runs",
        "kind"}}, "op_size": int, "dp_size": int, "updates": {"flat", "owner",
        "whole": parameter counts}, "owned": int, "balance": {"per_rank": [bytes], "ideal": float, "ratio":
        float}}``; ``optimizer_states`` is ``optimizer_moments + master_shards``. ``device``: the device MindSpore
        runs this rank on; ``backend`` and ``collectives``: how each collective runs there, MindSpore's own primitive
        (``"real"``) or a CPU emulation of the same result (``"emulated"``; :func:`mindzero.core.topology.
        collective_routes`). ``owned``: the owner-mode
        parameters this rank updates; ``balance``: the optimizer-state bytes (states only) of every op rank from
        the plan, and the largest over their mean.
    """
    info = train_net.zero_info
    # the store's bytes (:mod:`mindzero.engine.states`): disk offload adds what is on disk and its stream's slots
    held = train_net.states.bytes()
    moments, store_gradients = held.pop("optimizer_moments"), held.pop("gradients")
    masters = sum(nbytes(p) for p in info.master_shards)
    updates = info.updates
    spread = balance(updates, [every_rank_bytes(ps.spec, ps.update) for ps in info.params], info.world.op_size)
    return {
        **held,
        "parameters": sum(nbytes(p) for p in train_net.network.get_parameters()),
        "gradients": sum(nbytes(p) for p in info.accum_buffers) + store_gradients,
        "optimizer_moments": moments,
        "master_shards": masters,
        "optimizer_states": moments + masters,
        "ema": sum(nbytes(p) for p in train_net.ema.ema_weights) if train_net.has_ema else 0,
        "expected": expected_bytes(info.plan, info.config, {ps.name: ps.update for ps in info.params},
                                   info.world.op_rank, train_net.has_ema, splits_parameters(info.layout.optimizer)),
        "stage": info.config.zero_stage,
        "device": info.world.device,  # the device MindSpore runs this rank on
        "backend": info.world.backend,  # how its collectives run (mindzero.core.topology.BACKENDS)
        "collectives": {r.operation: {"runs": r.runs, "kind": r.kind} for r in info.world.routes()},
        "op_size": info.world.op_size,  # the op group: what the shards divide by
        "dp_size": info.world.dp_size,
        "updates": {mode: sum(u.mode == mode for u in updates) for mode in ("flat", "owner", "whole")},
        "owned": sum(u.owned_by(info.world.op_rank) for u in updates),
        "balance": {"per_rank": list(spread.loads), "ideal": spread.ideal, "ratio": spread.ratio},
    }


def formulas_line(info, n_states: int) -> str:
    """The fp32 and the mixed-precision formula of this stage, side by side, for the optimized parameters (with
    gradient buffers: the formulas count them), saying which one this run follows."""
    phi = sum(s.numel for s in info.plan if s.optimized)
    both = both_formulas(phi, info.config.zero_stage, info.world.op_size, n_states)
    this = "mixed precision" if info.precision.enabled else "fp32"
    return (f"  formulas (Φ = {phi} optimized parameters, N = {info.world.op_size}, {n_states} states each): fp32 "
            f"{both['fp32']['total'] / 2 ** 20:.3f} MiB, mixed precision (param_dtype) "
            f"{both['mixed_precision']['total'] / 2 ** 20:.3f} MiB; this run: {this}")


def plan_text(train_net) -> str:
    """The verbose log of ``prepare_train_network``: stage, groups, per-rank bytes by kind next to the
    formula, replicated parameters with reasons, and the communication per step."""
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
    if info.precision.reduce_dtype is not None and not info.precision.enabled:
        lines.append(f"gradients of fp32 parameters reduced in {info.precision.reduce_dtype}, widened to fp32 "
                     "before the mean")
    quant = config.stage3.quantization
    if quant is not None:
        quantized = [s for s in info.plan if s.sharded and quant.applies(s.name, s.shape)]
        exact = sum(s.shard_size * s.itemsize for s in quantized)
        lines.append(f"weight gathers: {quant.kind} with an fp32 scale per {quant.block_size} elements for "
                     f"{len(quantized)} of {len(info.plan.sharded)} sharded parameters: "
                     f"{report['expected']['quantization_buffers'] / mib:.3f} MiB sent per gather round instead of "
                     f"{exact / mib:.3f} MiB (kept from forward for the backward re-gather)")
    if info.units:
        full = [sum(info.plan[n].numel * info.plan[n].itemsize for n in unit) for unit in info.units]
        largest = max(s.numel * s.itemsize for s in info.plan.sharded)
        plural = "s" if len(info.units) > 1 else ""
        lines.append(f"weight gathers: {len(info.units)} unit{plural} of {sum(len(u) for u in info.units)} parameters "
                     f"({config.stage3.units.as_setting()!r}), one all-gather each; the largest unit "
                     f"{max(full) / mib:.3f} MiB gathered at once (transient; the largest parameter: "
                     f"{largest / mib:.3f} MiB)")
    lines.append(routes_line(world))
    lines += updates_lines(info, report)
    for kind in ("parameters", "gradients", "optimizer_states"):
        lines.append(f"  {kind:<17} {report[kind] / mib:10.3f} MiB (plan {report['expected'][kind] / mib:.3f} MiB)")
    where = train_net.states.describe()
    if where is not None:
        lines.append(f"  {'on disk':<17} {where}")
    lines.append(formulas_line(info, len(info.state_attrs)))
    lines.append(info.plan.summary())
    lines.append(format_comm(info.calls, info.real_calls if world.emulated else None))
    return "\n".join(lines)


def routes_line(world) -> str:
    """This rank's device and how each collective of the step runs on it (real, emulated, ...)."""
    routes = "; ".join(f"{r.operation} {r.runs} [{r.kind}]" for r in world.routes())
    return f"collectives on {world.device} ({world.backend} backend): {routes}"


def updates_lines(info, report) -> list:
    """How the optimizer's update is shared out: per mode the parameters, each owner-mode one with its owner and
    why, the optimizer-state bytes per op rank against the even share, and what owner mode communicates."""
    mib = 2 ** 20
    counts = report["updates"]
    name = type(info.layout.optimizer).__name__
    lines = [f"optimizer {name}: {counts['flat']} parameters sharded flat (element-wise), {counts['owner']} updated "
             f"whole on an owner rank, {counts['whole']} whole on every rank"]
    owned = [ps for ps in info.params if ps.update.mode == OWNER]
    for ps in owned[:8]:
        lines.append(f"  owner {ps.update.owner}: {ps.name} {tuple(ps.spec.shape)}, states "
                     f"{ps.update.state_bytes / mib:.3f} MiB ({ps.update.why})")
    if len(owned) > 8:
        lines.append(f"  ... and {len(owned) - 8} more owner-mode parameters")
    if counts["owner"]:
        spread = report["balance"]
        per_rank = ", ".join(f"{b / mib:.3f}" for b in spread["per_rank"])
        lines.append(f"  optimizer states per op rank: {per_rank} MiB; the most loaded {spread['ratio']:.3f}x the "
                     "even share")
        added = summarize([c for b in info.owner_grads for c in all_gather_calls(b.specs, info.world, "update")]
                          + [c for b in info.broadcasts for c in broadcast_calls(b.specs, info.world, "update")])
        lines.append(f"  owner mode adds per step: {len(info.owner_grads)} all-gathers of gradients and "
                     f"{len(info.broadcasts)} broadcasts of updated parameters, "
                     f"{added['total']['traffic'] / mib:.3f} MiB of traffic per rank")
    return lines

"""What a built train step holds and does: :func:`memory_report` (bytes counted from the tensors a rank
holds, next to the plan's) and :func:`plan_text` (the verbose log of ``prepare_train_network``)."""
from __future__ import annotations

from ..core.comm_plan import format_comm
from ..core.estimate import both_formulas
from ..core.memory import expected_bytes
from .optim import optimizer_state_params, splits_parameters


def memory_report(train_net) -> dict:
    """Bytes this rank holds persistently, counted from the tensors actually allocated.

    Returns:
        ``{"parameters", "gradients", "optimizer_states", "optimizer_moments", "master_shards", "ema": int,
        "expected": {same keys}, "stage": int, "op_size": int, "dp_size": int}``; ``optimizer_states`` is
        ``optimizer_moments + master_shards``.
    """
    info = train_net.zero_info
    disk = info.offload
    # with disk offload the optimizer holds one-element stand-ins: the states are in the file (optimizer_disk)
    moments = 0 if disk else sum(_nbytes(p) for p in optimizer_state_params(train_net.optimizer, info.state_attrs))
    masters = sum(_nbytes(p) for p in info.master_shards)
    extra = {}
    if disk is not None:
        extra = {"optimizer_disk": disk.disk_bytes, "disk_io_per_step": 2 * disk.disk_bytes,
                 "offload_buffers": disk.buffer_bytes}
    return {
        **extra,
        "parameters": sum(_nbytes(p) for p in train_net.network.get_parameters()),
        "gradients": sum(_nbytes(p) for p in info.accum_buffers) + (disk.grad_bytes if disk else 0),
        "optimizer_moments": moments,
        "master_shards": masters,
        "optimizer_states": moments + masters,
        "ema": sum(_nbytes(p) for p in train_net.ema.ema_weights) if train_net.has_ema else 0,
        "expected": expected_bytes(info.plan, info.config.policy, len(info.state_attrs),
                                   info.config.gradient_accumulation_steps > 1, train_net.has_ema, info.precision,
                                   info.config.stage3.quantization, info.config.offload if disk else None,
                                   splits_parameters(train_net.optimizer)),
        "stage": info.config.zero_stage,
        "op_size": info.world.op_size,  # the op group: what the shards divide by
        "dp_size": info.world.dp_size,
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


def _nbytes(tensor) -> int:
    return int(tensor.nbytes)


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
    if info.split_pairs:
        lines.append(f"parameters held once: {len(info.split_pairs)} split into this rank's shard (what the optimizer "
                     "updates) and the rest (written by the all-gather); no fp32 master copy")
    for kind in ("parameters", "gradients", "optimizer_states"):
        lines.append(f"  {kind:<17} {report[kind] / mib:10.3f} MiB (plan {report['expected'][kind] / mib:.3f} MiB)")
    disk = info.offload
    if disk is not None:
        lines.append(f"  {'on disk':<17} {report['optimizer_disk'] / mib:10.3f} MiB of optimizer states in "
                     f"{disk.file.path} ({len(disk.layout.pieces)} pieces of at most "
                     f"{disk.layout.piece_bytes / mib:.3f} MiB, {'cut inside parameters' if splits_parameters(train_net.optimizer) else 'whole parameters: this optimizer is not cut'}); "
                     f"per update {report['optimizer_disk'] / mib:.3f} MiB read + "
                     f"{report['optimizer_disk'] / mib:.3f} MiB written; resident for the stream: "
                     f"{report['offload_buffers'] / mib:.3f} MiB of slots and the gradient buffers (in gradients)")
    lines.append(formulas_line(info, len(info.state_attrs)))
    lines.append(info.plan.summary())
    lines.append(format_comm(info.calls, info.real_calls if world.emulated else None))
    return "\n".join(lines)

"""The collectives of one training step, before step 1 (pure Python, no MindSpore import).

:func:`step_calls` lists every collective a rank issues in one optimizer step (``K``
micro-steps), in the order the train step issues them, from the partition plan, the
stage, the backend and ``comm_fusion``. The train step builds its reducers and gathers
from the same :func:`buckets`, so the list is what runs; ``tests/multirank`` counts the
collectives actually called (PyNative) and compares.

Sizes: ``nbytes`` is the full tensor of the call (an all-reduce's or reduce-scatter's
input, an all-gather's output). ``traffic`` is what a ring algorithm sends per rank:
all-reduce ``2 (n-1)/n x nbytes``, reduce-scatter and all-gather ``(n-1)/n x nbytes``
(the ZeRO paper's accounting: stage 0 moves 2Φ, stages 1-2 2Φ, stage 3 3Φ).

On CPU (``emulated``) a reduce-scatter is an all-reduce over the world of the unpadded
tensor (twice a real reduce-scatter's traffic), and a hybrid op-group all-gather is a
world all-gather (``R`` times the bytes); :func:`emulation_extra` reports the difference.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import FusionConfig, StagePolicy

OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class CommShape:
    """Who communicates: the op group (``G``), the world (``N = R x G``) and whether the backend
    emulates reduce-scatter and sub-group collectives with world collectives (CPU)."""

    group_size: int
    world_size: int
    emulated: bool

    @property
    def replicas(self) -> int:
        return self.world_size // self.group_size


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


def spec_buckets(specs, fusion: FusionConfig, kind: str) -> list:
    """:func:`buckets` of ``specs`` (full-tensor bytes, dtype) for the fusion ``kind``."""
    return buckets([s.numel * s.itemsize for s in specs], [s.dtype for s in specs], fusion.bucket_bytes(kind))


def reduce_scatter_calls(specs, shape: CommShape, phase: str) -> list:
    """One fused reduce-scatter (sum over the world, shard over the op group) of ``specs``."""
    if shape.world_size == 1:
        return []
    if shape.emulated:
        return [Call("all_reduce", phase, shape.world_size, sum(s.numel * s.itemsize for s in specs), len(specs))]
    calls = [Call("reduce_scatter", phase, shape.group_size, sum(s.padded_numel * s.itemsize for s in specs),
                  len(specs))]
    if shape.replicas > 1:
        calls.append(Call("all_reduce", phase, shape.replicas, sum(s.shard_size * s.itemsize for s in specs),
                          len(specs)))
    return calls


def all_gather_calls(specs, shape: CommShape, phase: str) -> list:
    """One fused all-gather of ``specs``' shards over the op group."""
    if shape.group_size == 1:
        return []
    ranks = shape.world_size if shape.emulated else shape.group_size
    return [Call("all_gather", phase, ranks, sum(s.shard_size * s.itemsize for s in specs) * ranks, len(specs))]


def all_reduce_calls(specs, shape: CommShape, phase: str) -> list:
    """One fused all-reduce (sum over the world) of ``specs``' full gradients."""
    if shape.world_size == 1:
        return []
    return [Call("all_reduce", phase, shape.world_size, sum(s.numel * s.itemsize for s in specs), len(specs))]


def step_calls(opt_specs, sharded, policy: StagePolicy, shape: CommShape, fusion: FusionConfig,
               accum_steps: int = 1, clip_grad: bool = False, regather: bool = True, reduce_specs=None) -> list:
    """Every collective of one optimizer step, in issue order.

    Args:
        opt_specs: the optimizer's parameters' :class:`~mindzero.plan.ShardSpec`, in optimizer order, with
            the dtype the parameters are held (and gathered) in.
        sharded: per entry, whether its optimizer state is sharded (stage >= 1 and the plan shards it).
        regather: stage 3 all-gathers each parameter again in backward instead of keeping it.
        reduce_specs: the same specs with the dtype gradients are reduced in (mixed precision's
            ``reduce_dtype``); ``None``: ``opt_specs``.
    """
    reduce_specs = opt_specs if reduce_specs is None else reduce_specs
    sh = [s for s, f in zip(opt_specs, sharded) if f]
    sh_r = [s for s, f in zip(reduce_specs, sharded) if f]
    rep = [s for s, f in zip(reduce_specs, sharded) if not f]
    micro, boundary, update = [], [], []
    if policy.shard_parameters:
        for s in sh:  # one gather per parameter where it is used; fusion does not apply
            micro += all_gather_calls([s], shape, "forward")
        for s, r in zip(reversed(sh), reversed(sh_r)):
            if regather:
                micro += all_gather_calls([s], shape, "backward")
            micro += reduce_scatter_calls([r], shape, "backward")
    elif policy.shard_gradients:
        for b in spec_buckets(sh_r, fusion, "reduce_scatter"):
            micro += reduce_scatter_calls([sh_r[i] for i in b], shape, "backward")
    elif policy.shard_optimizer_states:
        for b in spec_buckets(sh_r, fusion, "reduce_scatter"):
            boundary += reduce_scatter_calls([sh_r[i] for i in b], shape, "boundary")
    full = rep if policy.shard_optimizer_states else list(reduce_specs)
    for b in spec_buckets(full, fusion, "allreduce"):
        boundary += all_reduce_calls([full[i] for i in b], shape, "boundary")
    if shape.world_size > 1:
        boundary.append(Call("all_reduce", "boundary", shape.world_size, 4))  # the overflow flag
    if clip_grad and any(s.sharded for s in opt_specs) and shape.group_size > 1:
        emulate = shape.emulated and shape.replicas > 1
        boundary.append(Call("all_reduce", "boundary", shape.world_size if emulate else shape.group_size,
                             4 * (shape.replicas if emulate else 1)))
    if policy.shard_optimizer_states and not policy.shard_parameters:
        for b in spec_buckets(sh, fusion, "allgather"):
            update += all_gather_calls([sh[i] for i in b], shape, "update")
    return micro * accum_steps + boundary + update


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

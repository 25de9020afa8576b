"""Bytes a rank holds persistently: what the partition plan predicts, and what is actually allocated.

Kinds (integer bytes per rank):

* ``parameters``: the network's Parameters (full at stages 0-2; shards of the
  sharded ones at stage 3), trainable or not;
* ``gradients``: persistent gradient buffers, i.e. accumulation buffers when
  ``gradient_accumulation_steps > 1`` (full at stages 0-1, shards at 2-3); 0
  otherwise, since gradients then live only inside the step;
* ``optimizer_states``: the optimizer's per-parameter states (moments) plus
  the master values the optimizer updates beside the parameters (``master_shards``: with
  ``param_dtype``, fp32 masters at every stage, shards at stages 1-2; without it the stage-2 fp32
  master shard); step counters
  and learning rates are not counted.

The ZeRO paper's mixed-precision formulas (16Φ, 4Φ+12Φ/N, 2Φ+14Φ/N, 16Φ/N)
are what a run with ``param_dtype=float16`` (or bfloat16) allocates, with
reduce_dtype = param_dtype, Adam and K>1: parameters 2Φ (stage 3: 2Φ/N),
gradient buffers 2Φ (stages 2-3: 2Φ/N), fp32 master values 4Φ and moments 8Φ
(stages 1-3: 12Φ/N). Without ``param_dtype`` mindzero trains the parameters in
their own dtype (fp32 here) and keeps no master copy except stage 2's: the parameter is its own master (at
stage 1 each sharded one is held as this rank's shard, which the optimizer updates, plus the rest: no element
twice, :mod:`mindzero.engine.split`, which says why not stage 2): stage 0: 4Φ + 4Φ + 8Φ; stage 1:
4Φ + 4Φ + 8Φ/N; stage 2: 4Φ + 4Φ/N + 12Φ/N (the master shard 4Φ/N); stage 3: 4Φ/N + 4Φ/N + 8Φ/N
(gradient buffers as the second term).
"""
from __future__ import annotations

from .config import MixedPrecision, StagePolicy
from .offload import StateLayout, slot_bytes
from .plan import PartitionPlan, dtype_bytes, splits_evenly
from .quant import payload_bytes

KINDS = ("parameters", "gradients", "optimizer_states")


def expected_bytes(plan: PartitionPlan, policy: StagePolicy, n_states: int, accumulate: bool,
                   ema: bool = False, precision: MixedPrecision = MixedPrecision(), quant=None,
                   offload=None, split_pieces: bool = True) -> dict:
    """Per-rank bytes by kind that ``plan`` predicts (pure arithmetic, no MindSpore).

    Args:
        plan: the partition plan of all network parameters (dtypes as held: ``param_dtype`` for the
            optimized ones of a mixed-precision run).
        policy: the stage.
        n_states: per-parameter state tensors of the optimizer (Adam 2, Momentum 1, SGD 2).
        accumulate: gradient accumulation buffers exist (``gradient_accumulation_steps > 1``).
        ema: an EMA of the optimized parameters is kept (reported under ``ema``, held like the parameters).
        precision: the mixed-precision policy: fp32 masters and states, buffers in ``reduce_dtype``.
        quant: stage 3's :class:`~mindzero.core.quant.GatherQuantization` (or ``None``): reported under
            ``quantization_buffers`` (only then), the payloads (int8 values and fp32 scales of this rank's shards) a step
            keeps from forward to the backward re-gather; transient (alive during a step), not in the kinds.
        offload: an :class:`~mindzero.core.offload.OffloadPolicy` with ``tier="disk"``, or ``None``: the optimizer's
            moments go to disk (``optimizer_disk``; ``optimizer_moments`` in memory 0), with ``accumulate`` every
            optimized parameter gets a gradient buffer of its target's shape (counted in ``gradients``), and the stream's slots are
            ``offload_buffers`` (in no kind); ``disk_io_per_step``: bytes read plus written per update.
        split_pieces: the optimizer's parameters may be cut into pieces
            (:func:`mindzero.engine.optim.splits_parameters`), which sizes the slots.
    """
    out = dict.fromkeys(KINDS, 0)
    out["ema"] = 0
    out["optimizer_moments"] = 0
    out["master_shards"] = 0
    mixed = precision.enabled
    disk = offload is not None and offload.disk
    targets = []  # (elements, bytes per element) of each optimizer target, for the disk layout
    for s in plan:
        # stage 1 without param_dtype splits each sharded optimized parameter into its shard and the rest
        # (stage 1 only, over more than one rank, every shard holding an element: else the master shard stays;
        # mindzero.engine.split.split_layout says why not stage 2)
        stage12 = s.sharded and policy.shard_optimizer_states and not policy.shard_parameters
        split = (stage12 and not policy.shard_gradients and s.optimized and not mixed and s.op_size > 1
                 and splits_evenly(s))
        numel = s.shard_size if (policy.shard_parameters and s.sharded) else s.numel
        held = s.numel + s.padding if split else numel  # the rest and the shard, padding included
        out["parameters"] += held * s.itemsize
        if not s.optimized:  # frozen weights and buffers: no gradient, no optimizer state, no EMA
            continue
        # fp32 values (masters, moments, EMA) of a mixed-precision run: 4 bytes whatever the held dtype
        wide = dtype_bytes("float32") if mixed else s.itemsize
        state_numel = s.shard_size if (policy.shard_optimizer_states and s.sharded) else s.numel
        out["optimizer_moments"] += n_states * state_numel * wide
        targets.append((state_numel, wide))
        if ema:
            out["ema"] += numel * wide
        if (mixed and s.dtype == precision.param_dtype) or (stage12 and not split):
            out["master_shards"] += state_numel * wide
        if accumulate:
            narrow = precision.reduce_in and (mixed or s.dtype == "float32")
            grad_item = dtype_bytes(precision.reduce_in) if narrow else s.itemsize
            out["gradients"] += (s.shard_size if (policy.shard_gradients and s.sharded) else s.numel) * grad_item
    if disk:
        layout = StateLayout.build([n for n, _ in targets], [max((w for _, w in targets), default=4)] * n_states,
                                   offload.chunk_bytes, split_pieces)
        out["optimizer_disk"] = layout.nbytes  # the moments, each piece's states 64-byte aligned
        out["disk_io_per_step"] = 2 * out["optimizer_disk"]
        out["optimizer_moments"] = 0
        if accumulate:  # the boundary's gradients wait for the update in buffers (without: the step's output)
            out["gradients"] += sum(n * w for n, w in targets)
        out["offload_buffers"] = slot_bytes(layout, [w for _, w in targets])
    out["optimizer_states"] = out["optimizer_moments"] + out["master_shards"]
    if quant is not None:
        out["quantization_buffers"] = sum(payload_bytes(s.shard_size, quant.block_size) for s in plan
                                          if policy.shard_parameters and s.sharded and quant.applies(s.name, s.shape))
    return out

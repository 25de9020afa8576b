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

How each optimized parameter's states are shared out is its :class:`~mindzero.core.optim_plan.Update`: a flat
parameter's element states are shards on every rank (its one-value states whole), an owner-mode parameter's
states are all on its owner, a whole one's on every rank.

The ZeRO paper's mixed-precision formulas (16Φ, 4Φ+12Φ/N, 2Φ+14Φ/N, 16Φ/N)
are what a run with ``param_dtype=float16`` (or bfloat16) allocates, with
reduce_dtype = param_dtype, Adam and K>1: parameters 2Φ (stage 3: 2Φ/N),
gradient buffers 2Φ (stages 2-3: 2Φ/N), fp32 master values 4Φ and moments 8Φ
(stages 1-3: 12Φ/N). Without ``param_dtype`` mindzero trains the parameters in
their own dtype (fp32 here); at stages 1-2 the network keeps the user's full parameters and the optimizer
updates a master shard of each, all-gathered back: stage 0: 4Φ + 4Φ + 8Φ; stage 1: 4Φ + 4Φ + 12Φ/N; stage 2:
4Φ + 4Φ/N + 12Φ/N; stage 3: 4Φ/N + 4Φ/N + 8Φ/N (gradient buffers as the second term).
"""
from __future__ import annotations

from .config import ZeroConfig
from .offload import StateLayout, slot_bytes
from .optim_plan import ELEMENT, FLAT, OWNER, placeholder_shape
from .plan import PartitionPlan, dtype_bytes
from .quant import payload_bytes

KINDS = ("parameters", "gradients", "optimizer_states")


def expected_bytes(plan: PartitionPlan, config: ZeroConfig, updates: dict, op_rank: int = 0, ema: bool = False,
                   split_pieces: bool = True) -> dict:
    """Per-rank bytes by kind that ``plan`` predicts for op rank ``op_rank`` (pure arithmetic, no MindSpore).

    Args:
        plan: the partition plan of all network parameters (dtypes as held: ``param_dtype`` for the
            optimized ones of a mixed-precision run).
        config: the :class:`~mindzero.core.config.ZeroConfig`: its stage, precision (fp32 masters and states,
            buffers in ``reduce_dtype``), gradient accumulation (buffers exist with ``gradient_accumulation_steps >
            1``), stage 3's quantized gathers (reported under ``quantization_buffers``, only then: the payloads a
            step keeps from forward to the backward re-gather; transient, in no kind) and disk offload (the
            moments on disk: ``optimizer_disk``, ``disk_io_per_step`` read plus written per update, the stream's
            slots ``offload_buffers`` in no kind, a gradient buffer per optimized parameter with accumulation).
        updates: parameter name -> its :class:`~mindzero.core.optim_plan.Update` (its states, mode and owner), for
            every optimized parameter.
        op_rank: whose bytes: owner-mode states count on their owner only.
        ema: an EMA of the optimized parameters is kept (reported under ``ema``, held like the parameters).
        split_pieces: disk offload may cut the optimizer's parameters into pieces, which sizes the slots.
    """
    policy, precision = config.policy, config.precision
    offload = config.offload if config.offload.disk else None
    out = dict.fromkeys(KINDS, 0)
    out.update(ema=0, optimizer_moments=0, master_shards=0)
    mixed = precision.enabled
    targets = []  # (elements, bytes per element) of each optimizer target, for the disk layout
    for s in plan:
        numel = s.shard_size if (policy.shard_parameters and s.sharded) else s.numel
        out["parameters"] += numel * s.itemsize
        if not s.optimized:  # frozen weights and buffers: no gradient, no optimizer state, no EMA
            continue
        update = updates[s.name]
        # fp32 values (masters, EMA) of a mixed-precision run: 4 bytes whatever the held dtype
        wide = dtype_bytes("float32") if mixed else s.itemsize
        flat = update.mode == FLAT
        mine = update.mode != OWNER or update.owned_by(op_rank)
        out["optimizer_moments"] += sum(_state_bytes(st, s, flat, mine) for st in update.states)
        state_numel = s.shard_size if flat else s.numel
        targets.append((state_numel, wide))
        if ema:
            out["ema"] += numel * wide
        if flat and not policy.shard_parameters:  # stages 1-2: a master shard beside the full parameter
            out["master_shards"] += s.shard_size * wide
        elif update.mode == OWNER:  # the owner's full master (param_dtype, or stage 3 where the network holds shards)
            out["master_shards"] += s.numel * wide if mine and (mixed or policy.shard_parameters) else 0
        elif mixed and s.dtype == precision.param_dtype:
            out["master_shards"] += numel * wide
        if config.gradient_accumulation_steps > 1:
            narrow = precision.reduce_in and (mixed or s.dtype == "float32")
            grad_item = dtype_bytes(precision.reduce_in) if narrow else s.itemsize
            out["gradients"] += (s.shard_size if (policy.shard_gradients and s.sharded) else s.numel) * grad_item
    if offload is not None:
        n_states = max((len(u.states) for u in updates.values()), default=0)
        layout = StateLayout.build([n for n, _ in targets], [max((w for _, w in targets), default=4)] * n_states,
                                   offload.chunk_bytes, split_pieces)
        out["optimizer_disk"] = layout.nbytes  # the moments, each piece's states 64-byte aligned
        out["disk_io_per_step"] = 2 * out["optimizer_disk"]
        out["optimizer_moments"] = 0
        if config.gradient_accumulation_steps > 1:  # the boundary's gradients wait for the update in buffers
            out["gradients"] += sum(n * w for n, w in targets)
        out["offload_buffers"] = slot_bytes(layout, [w for _, w in targets])
    out["optimizer_states"] = out["optimizer_moments"] + out["master_shards"]
    quant = config.stage3.quantization
    if quant is not None:
        out["quantization_buffers"] = sum(payload_bytes(s.shard_size, quant.block_size) for s in plan
                                          if policy.shard_parameters and s.sharded and quant.applies(s.name, s.shape))
    return out


def _state_bytes(state, spec, flat: bool, mine: bool) -> int:
    """Bytes a rank holds of one optimizer ``state`` of the parameter ``spec``: a flat parameter's element state
    as a shard, an owner-mode one whole on its owner (``mine``) and as a stand-in elsewhere, else whole."""
    if flat and state.layout == ELEMENT:
        return spec.shard_size * dtype_bytes(state.dtype)
    if not mine:
        shape = placeholder_shape(spec.shape, state.shape)
        count = 1
        for d in shape:
            count *= d
        return count * dtype_bytes(state.dtype)
    return state.nbytes

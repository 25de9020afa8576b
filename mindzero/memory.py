"""Bytes a rank holds persistently: what the partition plan predicts, and what is actually allocated.

Kinds (integer bytes per rank):

* ``parameters``: the network's Parameters (full at stages 0-2; shards of the
  sharded ones at stage 3), trainable or not;
* ``gradients``: persistent gradient buffers, i.e. accumulation buffers when
  ``gradient_accumulation_steps > 1`` (full at stages 0-1, shards at 2-3); 0
  otherwise, since gradients then live only inside the step;
* ``optimizer_states``: the optimizer's per-parameter states (moments) plus,
  at stages 1-2, the fp32 master shards the optimizer updates; step counters
  and learning rates are not counted.

The ZeRO paper's mixed-precision formulas (16Φ, 4Φ+12Φ/N, 2Φ+14Φ/N, 16Φ/N)
assume fp16 parameters and gradients with an fp32 master copy. mindzero trains
the parameters in their own dtype (fp32 here), so with Adam and K>1 the
per-rank bytes are: stage 0: 4Φ + 4Φ + 8Φ; stage 1: 4Φ + 4Φ + 12Φ/N (the master
shard costs 4Φ/N); stage 2: 4Φ + 4Φ/N + 12Φ/N; stage 3: 4Φ/N + 4Φ/N + 8Φ/N.
"""
from __future__ import annotations

from .config import StagePolicy
from .plan import REASON_NOT_OPTIMIZED, PartitionPlan

KINDS = ("parameters", "gradients", "optimizer_states")


def expected_bytes(plan: PartitionPlan, policy: StagePolicy, n_states: int, accumulate: bool,
                   ema: bool = False) -> dict:
    """Per-rank bytes by kind that ``plan`` predicts (pure arithmetic, no MindSpore).

    Args:
        plan: the partition plan of all network parameters.
        policy: the stage.
        n_states: per-parameter state tensors of the optimizer (Adam 2, Momentum 1, SGD 2).
        accumulate: gradient accumulation buffers exist (``gradient_accumulation_steps > 1``).
        ema: an EMA of the optimized parameters is kept (reported under ``ema``, held like the parameters).
    """
    out = dict.fromkeys(KINDS, 0)
    out["ema"] = 0
    out["optimizer_moments"] = 0
    out["master_shards"] = 0
    for s in plan:
        full, shard = s.numel * s.itemsize, s.shard_size * s.itemsize
        out["parameters"] += shard if (policy.shard_parameters and s.sharded) else full
        optimized = s.reason != REASON_NOT_OPTIMIZED
        if not optimized:
            continue
        state_one = shard if (policy.shard_optimizer_states and s.sharded) else full
        out["optimizer_moments"] += n_states * state_one
        if ema:
            out["ema"] += shard if (policy.shard_parameters and s.sharded) else full
        if policy.shard_optimizer_states and s.sharded and not policy.shard_parameters:
            out["master_shards"] += shard
        if accumulate:
            out["gradients"] += shard if (policy.shard_gradients and s.sharded) else full
    out["optimizer_states"] = out["optimizer_moments"] + out["master_shards"]
    return out


def memory_report(train_net) -> dict:
    """Bytes this rank holds persistently, counted from the tensors actually allocated.

    Returns:
        ``{"parameters", "gradients", "optimizer_states", "optimizer_moments", "master_shards", "ema": int,
        "expected": {same keys}, "stage": int, "group_size": int, "replicas": int}``; ``optimizer_states`` is
        ``optimizer_moments + master_shards``.
    """
    from .optim import optimizer_state_params
    from .shard import tensor_nbytes

    info = train_net.zero_info
    moments = sum(tensor_nbytes(p) for p in optimizer_state_params(train_net.optimizer, info.state_attrs))
    masters = sum(tensor_nbytes(p) for p in info.master_shards)
    return {
        "parameters": sum(tensor_nbytes(p) for p in train_net.network.get_parameters()),
        "gradients": sum(tensor_nbytes(p) for p in info.accum_buffers),
        "optimizer_moments": moments,
        "master_shards": masters,
        "optimizer_states": moments + masters,
        "ema": sum(tensor_nbytes(p) for p in train_net.ema.ema_weights) if train_net.has_ema else 0,
        "expected": expected_bytes(info.plan, info.config.policy, len(info.state_attrs),
                                   info.config.gradient_accumulation_steps > 1, train_net.has_ema),
        "stage": info.config.zero_stage,
        "group_size": info.world.group_size,  # the op group: what the shards divide by
        "replicas": info.world.replicas,
    }

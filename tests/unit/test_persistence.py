"""Stage 3's persistence threshold without MindSpore: which parameters the plan keeps whole, the collectives of
the 105M GPT's step with and without it (one fused all-reduce where there were a gather, a re-gather and a
reduce-scatter each), the bytes it costs, the reshard keeping them whole, and the option's rules."""
import math

import pytest

from mindzero.core.comm_plan import PERSISTENT_BUCKET_BYTES, plan_state, step_calls, summarize
from mindzero.core.config import FusionConfig, ZeroConfig
from mindzero.core.estimate import estimate_memory
from mindzero.core.plan import REASON_BUFFER, REASON_PERSISTENT, ParamInfo, PartitionPlan, Persistence
from mindzero.core.topology import EMULATED, World


def gpt_infos(layers=14, dim=768, vocab=8192, seq=64):
    """The benchmark GPT's parameters (examples/gpt.py: tied head, 12 per block, final norm)."""
    infos = [ParamInfo("tok", (vocab, dim)), ParamInfo("pos", (seq, dim))]
    for i in range(layers):
        b = f"blocks.{i}."
        infos += [ParamInfo(b + "ln1.gamma", (dim,)), ParamInfo(b + "ln1.beta", (dim,)),
                  ParamInfo(b + "qkv.weight", (3 * dim, dim)), ParamInfo(b + "qkv.bias", (3 * dim,)),
                  ParamInfo(b + "proj.weight", (dim, dim)), ParamInfo(b + "proj.bias", (dim,)),
                  ParamInfo(b + "ln2.gamma", (dim,)), ParamInfo(b + "ln2.beta", (dim,)),
                  ParamInfo(b + "fc1.weight", (4 * dim, dim)), ParamInfo(b + "fc1.bias", (4 * dim,)),
                  ParamInfo(b + "fc2.weight", (dim, 4 * dim)), ParamInfo(b + "fc2.bias", (dim,))]
    return infos + [ParamInfo("ln_f.gamma", (dim,)), ParamInfo("ln_f.beta", (dim,))]


def gpt_calls(threshold, n=4, fusion=FusionConfig()):
    specs = list(PartitionPlan.build(gpt_infos(), n, 0, persistence=Persistence(threshold)))
    return step_calls(plan_state(specs, ZeroConfig(3), fusion), World.of_sizes(n, n, EMULATED))


def test_the_plan_keeps_small_parameters_whole_and_nothing_else():
    infos = [ParamInfo("w", (100, 100)), ParamInfo("b", (100,)), ParamInfo("scalar", ()),
             ParamInfo("bn.mean", (100,), optimized=False, written=True), ParamInfo("frozen.b", (10,), optimized=False),
             ParamInfo("edge", (99, 100))]
    plan = PartitionPlan.build(infos, 4, 1, persistence=Persistence(9_901))
    assert not plan["b"].sharded and plan["b"].reason == REASON_PERSISTENT
    assert plan["scalar"].reason == REASON_PERSISTENT and plan["frozen.b"].reason == REASON_PERSISTENT
    assert plan["bn.mean"].reason == REASON_BUFFER  # a buffer stays per rank: its reason is not replaced
    assert plan["w"].sharded  # 10,000 elements: not below 9,901
    assert not plan["edge"].sharded  # 9,900 < 9,901
    assert not plan["b"].per_rank  # every rank holds the same value (its gradient is all-reduced)
    assert all(s.sharded or s.reason == REASON_BUFFER for s in PartitionPlan.build(infos, 4, 1))  # 0: all sharded
    assert "smaller than stage3_param_persistence_threshold" in plan.summary()


def test_the_105m_gpt_steps_with_fewer_collectives():
    """Today 517 collectives per step at 4 ranks (3 per parameter and the overflow flag); with the threshold at
    DeepSpeed's 1e5 the 114 biases and norms (and the 49,152-element position table) cost one fused all-reduce."""
    base = summarize(gpt_calls(0))["total"]
    assert base["calls"] == 517
    calls = gpt_calls(100_000)
    persistent = [c for c in calls if c.op == "all_reduce" and c.tensors > 1]
    assert len(persistent) == 1 and persistent[0].tensors == 14 * 8 + 2 + 1
    got = summarize(calls)["total"]
    assert got["calls"] == 3 * (14 * 4 + 1) + 1 + 1 == 173  # 57 big weights, the fused all-reduce, the flag
    assert got["calls"] <= 0.6 * base["calls"]  # the goal: at least 40% fewer
    default = PartitionPlan.build(gpt_infos(), 4, 0, persistence=ZeroConfig(3).persistence)  # the defaults: the same
    assert [s.name for s in default.replicated] == [i.name for i in gpt_infos() if math.prod(i.shape) < 100_000]
    # bytes: the persistent parameters' gradients cross as an all-reduce (2(n-1)/n) instead of a gather, a
    # re-gather and a (CPU: all-reduce) reduce-scatter
    small = 4 * sum(math.prod(i.shape) for i in gpt_infos() if math.prod(i.shape) < 100_000)
    assert persistent[0].nbytes == small


def test_a_comm_fusion_bucket_bounds_the_fused_all_reduce():
    calls = gpt_calls(100_000, fusion=FusionConfig(allreduce=64 * 1024))
    fused = [c for c in calls if c.op == "all_reduce" and c.tensors > 1]
    assert len(fused) > 1 and all(c.nbytes <= 64 * 1024 for c in fused)
    boundary = [c for c in calls if c.phase == "boundary" and c.nbytes > 4]  # (not the overflow flag)
    assert sum(c.tensors for c in boundary) == 115 and all(c.op == "all_reduce" for c in boundary)
    assert PERSISTENT_BUCKET_BYTES == 32 * 2 ** 20


def test_what_it_costs_in_memory():
    """Each persistent parameter is held whole with its gradient and Adam moments: 16 bytes per element instead
    of 16/N; on the 105M GPT that is 0.14% of the parameters."""
    shapes = {i.name: i.shape for i in gpt_infos()}
    small = sum(math.prod(s) for s in shapes.values() if math.prod(s) < 100_000)
    accum = {"gradient_accumulation_steps": 2}  # the gradient buffers persist: counted
    sharded = estimate_memory(shapes, 3, 4, stage3_param_persistence_threshold=0, **accum)
    kept = estimate_memory(shapes, 3, 4, stage3_param_persistence_threshold=100_000, **accum)
    assert estimate_memory(shapes, 3, 4, **accum) == kept  # the default: DeepSpeed's 1e5, the 1% cap not reached
    extra = kept["total"] - sharded["total"]
    assert extra == pytest.approx(16 * small * 3 / 4, rel=0.01)
    assert extra / sharded["total"] < 0.01
    assert estimate_memory(shapes, 2, 4, stage3_param_persistence_threshold=100_000) == \
        estimate_memory(shapes, 2, 4, stage3_param_persistence_threshold=0)


def test_the_cap_keeps_a_small_model_sharded():
    """Every tensor of a small model is below 1e5 elements: the cap (1% of the model by default, DeepSpeed's
    ``stage3_model_persistence_threshold`` when given) keeps the smallest whole, ties in parameter order, and
    shards the rest; the choice is the same at any op group size."""
    infos = [ParamInfo("w1", (64, 64)), ParamInfo("b1", (64,)), ParamInfo("w2", (64, 16)), ParamInfo("b2", (16,)),
             ParamInfo("g", (16,)), ParamInfo("w3", (16, 64))]  # 6,240 elements: 1% is 62
    default = ZeroConfig.from_arguments({"zero_stage": 3}).persistence
    assert default == Persistence(100_000, None, 0.01)
    for n in (2, 4, 8):
        plan = PartitionPlan.build(infos, n, 0, persistence=default)
        assert [s.name for s in plan.replicated] == ["b2", "g"]  # 16 + 16 <= 62; b1's 64 would pass it
    capped = ZeroConfig.from_arguments({"zero_stage": 3, "stage3_model_persistence_threshold": 80}).persistence
    assert [s.name for s in PartitionPlan.build(infos, 4, 0, persistence=capped).replicated] == ["b2", "g"]  # 96 > 80
    wide = ZeroConfig.from_arguments({"zero_stage": 3, "stage3_model_persistence_threshold": 96}).persistence
    assert [s.name for s in PartitionPlan.build(infos, 4, 0, persistence=wide).replicated] == ["b1", "b2", "g"]
    assert not PartitionPlan.build(infos, 4, 0, persistence=Persistence(100_000, 0)).replicated
    assert len(PartitionPlan.build(infos, 4, 0, persistence=Persistence(100_000)).replicated) == 6  # no cap: all whole
    shapes = {i.name: i.shape for i in infos}
    assert estimate_memory(shapes, 3, 4)["total"] == \
        estimate_memory(shapes, 3, 4, stage3_param_persistence_threshold=17, stage3_model_persistence_threshold=32)["total"]


def test_the_option_and_its_rules():
    assert ZeroConfig.from_arguments({"zero_stage": 3, "stage3_param_persistence_threshold": 100}).persistence == \
        Persistence(100, None, 0.01)
    assert ZeroConfig.from_arguments({"zero_stage": 2, "stage3_param_persistence_threshold": 100}).persistence == \
        Persistence()
    assert ZeroConfig.from_arguments({"zero_stage": 3, "stage3_model_persistence_threshold": 5}).persistence == \
        Persistence(100_000, 5)
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match=f"stage3_model_persistence_threshold must be an int >= 0, got {bad!r}"):
            ZeroConfig.from_arguments({"zero_stage": 3, "stage3_model_persistence_threshold": bad})
    for bad in (-1, 1.5, True, "1e5"):
        with pytest.raises(ValueError, match=f"stage3_param_persistence_threshold must be an int >= 0, got {bad!r}"):
            ZeroConfig.from_arguments({"zero_stage": 3, "stage3_param_persistence_threshold": bad})
    with pytest.raises(ValueError, match="the share of the model kept whole must be a float in"):
        Persistence(10, None, 2.0)
    with pytest.raises(ValueError, match="persistence must be a Persistence"):
        PartitionPlan.build(gpt_infos(), 4, 0, persistence={"persist_below": 10})

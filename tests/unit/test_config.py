"""Stage policies, config validation and the memory formulas, without MindSpore."""
import subprocess
import sys
from pathlib import Path

import pytest

from mindzero.core.config import STAGES, MixedPrecision, ZeroConfig, stage_policy
from mindzero.core.memory import expected_bytes
from mindzero.core.optim_plan import OptimizerModel, planned_updates
from mindzero.core.plan import ParamInfo, PartitionPlan


def _expected(plan, stage, accumulate=True, ema=False, param_dtype=None, n_states=2, op_rank=0):
    """``expected_bytes`` of ``plan`` at ``stage`` for an element-wise optimizer with ``n_states`` states."""
    config = ZeroConfig(zero_stage=stage, gradient_accumulation_steps=2 if accumulate else 1,
                        precision=MixedPrecision.parse(param_dtype, None))
    optimized = [s for s in plan if s.optimized]
    updates = planned_updates(optimized, OptimizerModel(n_states), config.policy.shard_optimizer_states, plan.op_size)
    return expected_bytes(plan, config, {s.name: u for s, u in zip(optimized, updates)}, op_rank, ema)


def test_no_mindspore_import():
    code = "import sys, mindzero, mindzero.core.plan, mindzero.core.config, mindzero.core.memory; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


def test_stage_policies_are_cumulative():
    flags = [(p.shard_optimizer_states, p.shard_gradients, p.shard_parameters) for p in STAGES.values()]
    assert flags == [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]


@pytest.mark.parametrize("bad", [5, -1, 1.5, "2", True, None])
def test_bad_stage(bad):
    with pytest.raises(ValueError, match=f"zero_stage must be 0, 1, 2 or 3, got {bad!r}"):
        stage_policy(bad)


@pytest.mark.parametrize("field, value, rule", [
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps must be an int >= 1, got 0"),
    ("gradient_accumulation_steps", 2.0, "gradient_accumulation_steps must be an int >= 1, got 2.0"),
    ("clip_norm", 0.0, "clip_norm must be a number > 0, got 0.0"),
    ("clip_grad", 1, "clip_grad must be a bool, got 1"),
    ("drop_overflow_update", "yes", "drop_overflow_update must be a bool, got 'yes'"),
    ("compile_cache", 3, "compile_cache must be None or a directory path, got 3"),
    ("compile_cache", "", "compile_cache must be None or a directory path, got ''"),
])
def test_bad_config(field, value, rule):
    with pytest.raises(ValueError, match=rule):
        ZeroConfig(**{field: value})


def test_compile_cache_is_kept_as_a_path():
    assert ZeroConfig(compile_cache=Path("/tmp/steps")).compile_cache == "/tmp/steps"
    assert ZeroConfig.from_arguments({"compile_cache": "steps"}).compile_cache == "steps"
    assert ZeroConfig().compile_cache is None


def _plan(n, shard_frozen=True):
    # 105 + 4369 + 1 elements, all fp32; one replicated bias of 5; a buffer of 3; a frozen weight of 6
    infos = [ParamInfo("a", (7, 15)), ParamInfo("b", (17, 257)), ParamInfo("c", ()),
             ParamInfo("bias", (5,), parallel_optimizer=False), ParamInfo("bn.mean", (3,), optimized=False, written=True),
             ParamInfo("frozen", (6,), optimized=False)]
    return PartitionPlan.build(infos, n, 0, shard_frozen=shard_frozen)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_expected_bytes_by_hand(n):
    ss = [-(-105 // n), -(-4369 // n), -(-1 // n)]
    sharded_shard = 4 * sum(ss)
    full_opt = 4 * (105 + 4369 + 1 + 5)  # optimized parameters
    everything = full_opt + 4 * 3 + 4 * 6
    e0 = _expected(_plan(n), 0)
    assert e0 == dict(parameters=everything, gradients=full_opt, optimizer_states=2 * full_opt,
                      optimizer_moments=2 * full_opt, master_shards=0, ema=0)
    e1 = _expected(_plan(n), 1)
    # fp32 stages 1-2: the user's full parameters, and a master shard of each sharded one that the optimizer updates
    assert e1["optimizer_moments"] == 2 * (sharded_shard + 20)
    assert e1["master_shards"] == sharded_shard
    assert e1["gradients"] == full_opt and e1["parameters"] == everything
    mixed = _expected(_plan(n), 1, param_dtype="float16")
    assert mixed["master_shards"] == sharded_shard  # fp32 master shards beside the copies
    e2 = _expected(_plan(n), 2)
    assert e2["gradients"] == sharded_shard + 20 and e2["master_shards"] == e1["master_shards"]
    e3 = _expected(_plan(n), 3)
    # stage 3 shards the frozen weight too (no state for it); the buffer stays whole on every rank
    assert e3["parameters"] == sharded_shard + 20 + 12 + 4 * -(-6 // n) and e3["master_shards"] == 0
    kept = _expected(_plan(n, shard_frozen=False), 3)
    assert kept["parameters"] == sharded_shard + 20 + 12 + 4 * 6 and kept["optimizer_states"] == e3["optimizer_states"]
    assert e3["optimizer_states"] == 2 * (sharded_shard + 20)
    assert _expected(_plan(n), 3, accumulate=False)["gradients"] == 0
    # an EMA is held like the optimized parameters: full at stages 0-2, shards at stage 3
    assert _expected(_plan(n), 2, ema=True)["ema"] == full_opt
    assert _expected(_plan(n), 3, ema=True)["ema"] == sharded_shard + 20


@pytest.mark.parametrize("n", [2, 4])
def test_expected_bytes_of_an_owner_mode_optimizer(n):
    """An optimizer that is not element-wise (LAMB's model): each sharded parameter's two states whole on its
    owner, a stand-in of one element per state elsewhere; every rank's bytes add up to the states once."""
    plan = _plan(n)
    config = ZeroConfig(zero_stage=1)
    optimized = [s for s in plan if s.optimized]
    updates = planned_updates(optimized, OptimizerModel(2, elementwise=False), True, n)
    by_name = {s.name: u for s, u in zip(optimized, updates)}
    ranks = [expected_bytes(plan, config, by_name, r) for r in range(n)]
    owned = {s.name: u.owner for s, u in zip(optimized, updates) if u.mode == "owner"}
    assert sorted(owned) == ["a", "b", "c"]  # the replicated bias is updated whole on every rank
    stand_ins = [8 * sum(owner != r for owner in owned.values()) for r in range(n)]
    total = sum(r["optimizer_moments"] - s for r, s in zip(ranks, stand_ins))
    assert total == 2 * 4 * (105 + 4369 + 1) + n * 2 * 4 * 5
    assert all(r["master_shards"] == 0 for r in ranks)  # fp32 stages 1-2: the owner updates the user's parameter


def test_mixed_precision_policy_parse():
    assert MixedPrecision.parse() == MixedPrecision() and not MixedPrecision().enabled
    assert MixedPrecision.parse("Float16") == MixedPrecision("float16", "float16")
    assert MixedPrecision.parse("bfloat16", "float32") == MixedPrecision("bfloat16", "float32")
    with pytest.raises(ValueError, match="reduce_dtype must be None .*bfloat16 or float32 .*got 'float16'"):
        MixedPrecision.parse("bfloat16", "float16")
    with pytest.raises(ValueError, match="precision must be a MixedPrecision"):
        ZeroConfig(precision="float16")
    mp = MixedPrecision.parse("float16")
    assert mp.held("float32", True) == "float16" and mp.held("float32", False) == "float32"
    assert mp.held("float32", True, keep_fp32=True) == "float32" and mp.held("int32", True) == "int32"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_bytes_are_the_paper_formula(stage):
    """fp16 parameters and gradient buffers, fp32 masters and Adam moments: 16Φ, 4Φ+12Φ/N, 2Φ+14Φ/N, 16Φ/N
    exactly when every shape divides by N."""
    from mindzero.core.estimate import paper_formula

    plan = PartitionPlan.build([ParamInfo("a", (8, 4), "float16"), ParamInfo("b", (16,), "float16")], 4, 1)
    got = _expected(plan, stage, param_dtype="float16", op_rank=1)
    formula = paper_formula(48, stage, 4, mixed_precision=True)
    assert {k: got[k] for k in formula} == {k: int(v) for k, v in formula.items()}


def test_the_options_table_is_every_option_once():
    from mindzero.core.options import ARGUMENT_DEFAULTS, NOT_IN_SETTINGS, OPTIONS
    from mindzero.core.settings import SETTING_KEYS

    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names)) == 28
    assert ARGUMENT_DEFAULTS == {o.name: o.default for o in OPTIONS}
    assert set(SETTING_KEYS) == {o.name for o in OPTIONS if o.in_settings} and set(NOT_IN_SETTINGS).isdisjoint(SETTING_KEYS)
    config = ZeroConfig.from_arguments({})  # every default parses, and gives ZeroConfig's own defaults
    assert config == ZeroConfig()
    for o in OPTIONS:  # every name is one the parser knows
        ZeroConfig.from_arguments({o.name: o.default})
    with pytest.raises(ValueError, match="unknown option 'zero_stag'"):
        ZeroConfig.from_arguments({"zero_stag": 1})


def test_the_docs_option_list_is_the_table():
    from pathlib import Path

    from mindzero.core.options import options_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    assert options_markdown() in page, "docs/training.md's option list drifted from mindzero.core.options.OPTIONS"


def test_stage3_policy_is_the_one_stage_3_rule():
    from mindzero.core.config import Stage3Policy
    from mindzero.core.estimate import estimate_memory
    from mindzero.core.quant import GatherQuantization
    from mindzero.core.units import GatherUnits

    quant = GatherQuantization.parse("int8")
    rule = "gather_quantization='int8' needs zero_stage=3: it quantizes stage 3's weight gathers, and zero_stage=2 has none"
    with pytest.raises(ValueError, match=rule):
        ZeroConfig(2, stage3=Stage3Policy(quantization=quant))
    with pytest.raises(ValueError, match=rule):  # the estimate asks the same policy: the same message
        estimate_memory([100], 2, 2, gather_quantization="int8")
    units = Stage3Policy(units=GatherUnits.parse("blocks.*"))
    assert units.for_mode(True) is units
    with pytest.raises(ValueError, match=r"gather_units='blocks.\*' needs GRAPH_MODE"):
        units.for_mode(False)
    assert Stage3Policy().for_mode(False) == Stage3Policy(regather=False)  # PyNative does not re-gather
    with pytest.raises(ValueError, match="stage3_regather must be a bool, got 1"):
        Stage3Policy(regather=1)



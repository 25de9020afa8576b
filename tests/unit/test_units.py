"""Stage 3's gather units without MindSpore: the option, the grouping rules, and the plan's calls (one gather
per unit forward and backward, reductions unchanged)."""
import dataclasses

import pytest

from mindzero.core import quant as Q
from mindzero.core.comm_plan import plan_state, step_calls, summarize
from mindzero.core.config import ZeroConfig
from mindzero.core.plan import ParamInfo, PartitionPlan
from mindzero.core.topology import EMULATED, World
from mindzero.core.units import GatherUnits, Read, WeightGather, weight_gathers

F32 = ("float32",)


def test_parse():
    assert GatherUnits.parse(None) is None
    assert GatherUnits.parse(1 << 20) == GatherUnits(max_bytes=1 << 20)
    assert GatherUnits.parse("blocks.*") == GatherUnits(cells=("blocks.*",))
    assert GatherUnits.parse(["a", "b.*"]).cells == ("a", "b.*")
    assert GatherUnits.parse(["a"]).as_setting() == "a" and GatherUnits.parse(64).as_setting() == 64
    assert GatherUnits.parse(["a", "b"]).as_setting() == ["a", "b"]


@pytest.mark.parametrize("value, message", [
    (0, r"gather_units as a size must be an int >= 1 \(bytes of full parameters per unit\), got 0"),
    (-5, "got -5"),
    (1.5, r"gather_units must be None, an int \(bytes per unit\) or Cell-name patterns .*got 1.5"),
    ([], "got \\[\\]"),
    ([""], "got \\[''\\]"),
    (["a", 3], "got \\['a', 3\\]"),
    ({"cells": "a"}, "got {'cells': 'a'}"),
])
def test_parse_errors_name_value_and_rule(value, message):
    with pytest.raises(ValueError, match=message):
        GatherUnits.parse(value)


def test_settings_file_takes_gather_units(tmp_path):
    from mindzero.core.settings import ConfigError, load_config

    good = tmp_path / "good.yaml"
    good.write_text("zero_stage: 3\ngather_units: ['*blocks.*']\n")
    settings = load_config(good)
    config = ZeroConfig.from_arguments({k: v for k, v in settings.items() if k != "checkpoint"})
    assert config.stage3.units == GatherUnits(cells=("*blocks.*",))
    bad = tmp_path / "bad.yaml"
    bad.write_text("gather_units: 0\n")
    with pytest.raises(ConfigError, match=rf"{bad}: key 'gather_units': value 0: gather_units as a size must be an int >= 1"):
        load_config(bad)


def test_units_need_stage_3():
    with pytest.raises(ValueError, match=r"gather_units='blocks.\*' needs zero_stage=3: .*zero_stage=2 has none"):
        ZeroConfig.from_arguments({"zero_stage": 2, "gather_units": "blocks.*"})
    assert ZeroConfig.from_arguments({"zero_stage": 3, "gather_units": 4096}).stage3.units.max_bytes == 4096


def test_size_rule_groups_consecutive_parameters_of_one_kind():
    reads = [Read("a", "x", 40, F32), Read("b", "x", 40, F32), Read("c", "y", 40, F32),  # 120 > 100: c starts anew
             Read("d", "y", 500, F32),  # larger than the bound: alone (no unit)
             Read("e", "z", 10, ("float16",)), Read("f", "z", 10, ("float16",)),  # another dtype: a new unit
             Read("g", "z", 10, None),  # tied or quantized: its own gather, and it does not break e-f-h
             Read("h", "z", 10, ("float16",))]
    assert GatherUnits(max_bytes=100).group(reads) == [("a", "b"), ("e", "f", "h")]
    assert GatherUnits(max_bytes=10 ** 6).group(reads) == [("a", "b", "c", "d"), ("e", "f", "h")]
    assert GatherUnits(max_bytes=1).group(reads) == []


def test_cell_patterns_take_the_outermost_matching_cell():
    units = GatherUnits(cells=("*blocks.*",))
    assert units.unit_cell("gpt.blocks.3.attn.qkv") == "gpt.blocks.3"
    assert units.unit_cell("gpt.blocks") is None and units.unit_cell("gpt.ln_f") is None
    assert units.unit_cell("") is None
    reads = [Read("embed", "gpt.embed", 8, F32),
             Read("b0.w", "gpt.blocks.0.fc", 8, F32), Read("b0.g", "gpt.blocks.0.ln", 8, F32),
             Read("b1.w", "gpt.blocks.1.fc", 8, F32), Read("b1.t", "gpt.blocks.1", 8, None),
             Read("b1.h", "gpt.blocks.1.fc", 8, ("float16",)), Read("b1.g", "gpt.blocks.1.ln", 8, F32),
             Read("ln", "gpt.ln_f", 8, F32)]
    # by Cell, then by kind; a unit of one (b1.h) is no unit; parameters outside every match keep their own
    assert units.group(reads) == [("b0.w", "b0.g"), ("b1.w", "b1.g")]
    assert GatherUnits(cells=("gpt",)).group(reads) == [("embed", "b0.w", "b0.g", "b1.w", "b1.g", "ln")]


def _gpt_plan(world):
    infos = [ParamInfo("embed", (64, 16), "float32")]
    for b in range(2):
        infos += [ParamInfo(f"b{b}.w", (16, 48), "float32"), ParamInfo(f"b{b}.bias", (48,), "float32"),
                  ParamInfo(f"b{b}.g", (16,), "float32")]
    return PartitionPlan.build(infos, world.op_size, world.op_rank)


@pytest.mark.parametrize("regather", [True, False])
def test_the_plan_gathers_each_unit_once_and_reduces_each_parameter(regather):
    world = World.of_sizes(4, 4, EMULATED)
    plan = _gpt_plan(world)
    config = ZeroConfig.from_arguments({"zero_stage": 3})
    one = plan_state(list(plan), config, regather=regather)
    units = (("b0.w", "b0.bias", "b0.g"), ("b1.w", "b1.bias", "b1.g"))
    reads = [Read(s.name, s.name.split(".")[0], s.numel * 4, (s.dtype,)) for s in plan if s.sharded]
    grouped = dataclasses.replace(one, gathers=weight_gathers(reads, GatherUnits(cells=("b*",))))
    assert grouped.units == units
    per_param, per_unit = step_calls(one, world), step_calls(grouped, world)
    gathers = [c for c in per_unit if c.op == "all_gather"]
    phases = 2 if regather else 1
    assert len(gathers) == phases * 3  # embed and the two units, forward (and backward)
    assert len([c for c in per_param if c.op == "all_gather"]) == phases * 7
    unit_bytes = sum(plan[n].shard_size * 4 for n in units[0]) * 4  # every rank's shards of the unit
    assert sorted(c.nbytes for c in gathers if c.tensors == 3) == [unit_bytes] * (2 * phases)
    # the same bytes, the same reductions, fewer calls
    a, b = summarize(per_param), summarize(per_unit)
    assert a["all_gather"]["bytes"] == b["all_gather"]["bytes"] and a["all_reduce"] == b["all_reduce"]
    assert b["total"]["calls"] == a["total"]["calls"] - phases * 4
    # forward: a unit gathers where its first member is read; backward: where its last member's gradient is
    assert [(c.op, c.phase, c.tensors) for c in per_unit if c.op == "all_gather"][:3] == \
        [("all_gather", "forward", 1), ("all_gather", "forward", 3), ("all_gather", "forward", 3)]


def test_the_weight_gather_record_is_what_the_plan_counts():
    """weight_gathers: a unit's members share one record at its first member's place, a parameter in no unit
    (tied or quantized: kind None) has its own with its block size; step_calls issues one forward all-gather per
    record, of the members' shards (a quantized one: its payload), in the record's order."""
    world = World.of_sizes(4, 4, EMULATED)
    plan = _gpt_plan(world)
    reads = [Read("embed", "", plan["embed"].numel * 4, None)]  # tied: read by two Cells
    reads += [Read(s.name, s.name.split(".")[0], s.numel * 4, (s.dtype,)) for s in plan if s.name != "embed"]
    record = weight_gathers(reads, GatherUnits(cells=("b0",)), lambda name: 64 if name == "b1.w" else None)
    assert record == (WeightGather(("embed",)), WeightGather(("b0.w", "b0.bias", "b0.g")),
                      WeightGather(("b1.w",), 64), WeightGather(("b1.bias",)), WeightGather(("b1.g",)))
    assert weight_gathers(reads) == tuple(WeightGather((r.name,)) for r in reads)  # no units: one each
    state = dataclasses.replace(plan_state(list(plan), ZeroConfig.from_arguments({"zero_stage": 3})), gathers=record)
    forward = [c for c in step_calls(state, world) if c.phase == "forward"]
    assert [c.tensors for c in forward] == [1, 3, 1, 1, 1]
    assert forward[1].nbytes == 4 * sum(plan[n].shard_size * 4 for n in ("b0.w", "b0.bias", "b0.g"))
    assert forward[2].nbytes == 4 * Q.payload_bytes(plan["b1.w"].shard_size, 64)

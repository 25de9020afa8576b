"""estimate_memory and mindzero-estimate (pure): the ZeRO formulas, padding, replicated parameters."""
import json
import subprocess
import sys

import pytest

from mindzero.core.estimate import estimate_memory, main, paper_formula

PHI = 8 * 1024  # divisible by every group size below: plan arithmetic equals the formula exactly


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_estimate_equals_formula_when_shapes_divide(stage, n):
    """With accumulation (the gradient buffers persist, as the formulas count them)."""
    e = estimate_memory([(PHI // 8, 8)], stage, n, "adamw", gradient_accumulation_steps=4)
    want = {0: 16 * PHI, 1: 8 * PHI + 12 * PHI / n, 2: 4 * PHI + 16 * PHI / n, 3: 16 * PHI / n}[stage]
    assert e["total"] == want == e["formula"]["total"], (e, want)
    for kind in ("parameters", "gradients", "optimizer_states"):
        assert e[kind] == e["formula"][kind], kind


@pytest.mark.parametrize("stage,expr", [(0, lambda p, n: 16 * p), (1, lambda p, n: 4 * p + 12 * p / n),
                                        (2, lambda p, n: 2 * p + 14 * p / n), (3, lambda p, n: 16 * p / n)])
def test_paper_mixed_precision_formulas(stage, expr):
    for n in (2, 4, 64):
        f = paper_formula(10 ** 6, stage, n, mixed_precision=True)
        assert sum(f.values()) == pytest.approx(expr(10 ** 6, n))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_estimate_is_the_paper_formula(stage):
    """param_dtype=float16: fp16 parameters and buffers, fp32 masters and moments."""
    e = estimate_memory([PHI], stage, 4, "adamw", param_dtype="float16", gradient_accumulation_steps=4)
    for kind in ("parameters", "gradients", "optimizer_states"):
        assert e[kind] == e["formula"][kind], (stage, kind)
    assert e["master_shards"] == 4 * PHI / (1 if stage == 0 else 4)
    # reduce_dtype=float32: the accumulation buffers double, nothing else changes
    f = estimate_memory([PHI], stage, 4, "adamw", param_dtype="float16", reduce_dtype="float32",
                        gradient_accumulation_steps=4)
    assert f["gradients"] == 2 * e["gradients"] and f["optimizer_states"] == e["optimizer_states"]


def test_odd_shapes_pay_only_padding():
    shapes = {"w": (7, 15), "b": (17, 257), "s": (1,), "x": ()}
    phi = 7 * 15 + 17 * 257 + 1 + 1
    for n in (2, 3, 4, 8):
        e = estimate_memory(shapes, 3, n, "adam", gradient_accumulation_steps=2)
        assert e["phi"] == phi
        assert 16 * phi / n <= e["total"] <= 16 * (phi + 4 * (n - 1)) / n, (n, e["total"])  # < one element per tensor


def test_no_accumulation_has_no_persistent_gradients_and_momentum_has_one_state():
    assert estimate_memory([PHI], 2, 4)["gradients"] == 0  # gradient_accumulation_steps=1, as prepare's default
    assert estimate_memory([PHI], 2, 4, gradient_accumulation_steps=2)["gradients"] == 4 * PHI / 4
    assert estimate_memory([PHI], 0, 4, "momentum")["optimizer_states"] == 4 * PHI


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_stage=4, op_size=2), "zero_stage"),
    (dict(zero_stage=1, op_size=0), "op_size"),
    (dict(zero_stage=1, op_size=2, optimizer="rmsprop2"), "optimizer='rmsprop2'"),
    (dict(zero_stage=1, op_size=2, gradient_accumulation=True), "unknown option 'gradient_accumulation'"),
    (dict(zero_stage=1, op_size=2, optimizer_offload="disk"), "offload_dir must be a directory path"),
    (dict(zero_stage=1, op_size=2, reduce_dtype="float16"), "needs a loss scale"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory([PHI], **kwargs)
    with pytest.raises(ValueError, match="dimensions must be ints >= 0"):
        estimate_memory({"w": (3, -1)}, 1, 2)


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--params", "100M", "--op-sizes", "2,4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 3 | 4 | 95.4 | 95.4 | 190.7 | 381.5 | 381.5 | 16Φ/N |" in text, text
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and rows[0]["total"] == 16 * 10 ** 8


def test_cli_runs_without_mindspore():
    code = "import sys; from mindzero.core.estimate import main; main(['--params', '1000']); print('mindspore' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip().endswith("False"), res.stdout


@pytest.mark.parametrize("stage, fp32, mixed", [(0, 16, 16), (1, 8 + 12 / 4, 4 + 12 / 4), (2, 4 + 16 / 4, 2 + 14 / 4),
                                                (3, 16 / 4, 16 / 4)])
def test_both_formulas_side_by_side(stage, fp32, mixed):
    """fp32 (mindzero's: a master shard beside the user's parameter at stages 1-2) and the paper's mixed-precision bytes per parameter,
    Adam, N = 4; ``formula`` is the one of the run's precision."""
    phi = 1000
    e = estimate_memory([phi], stage, 4, "adam")
    assert e["formulas"]["fp32"]["total"] == pytest.approx(fp32 * phi)
    assert e["formulas"]["mixed_precision"]["total"] == pytest.approx(mixed * phi)
    assert e["formula"] == e["formulas"]["fp32"]
    assert estimate_memory([phi], stage, 4, "adam", param_dtype="float16")["formula"] == e["formulas"]["mixed_precision"]


@pytest.mark.parametrize("optimizer, states", [("mint.adam", 2), ("mint.adam_amsgrad", 3), ("mint.sgd", 1)])
def test_mint_optimizer_states(optimizer, states):
    """mint.optim's state counts: Adam's exp_avg and exp_avg_sq (AMSGrad adds max_exp_avg_sq), SGD's momentum_buf."""
    e = estimate_memory([1000], 0, 2, optimizer)
    assert e["optimizer_states"] == 4 * 1000 * states

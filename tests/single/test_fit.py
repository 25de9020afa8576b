"""mindzero.predict_peak / plan / mindzero-plan in one process: rehearsals of a small GPT as rank 0 of 2, what
the fit extrapolates against what the full network's rehearsal gives, and the refusals."""
import subprocess
import sys

import numpy as np
import pytest

import mindzero
from mindzero.core.fit import MIB
from mindzero.planner.factory import BlockLists, factory_ref
from mindzero.planner.planner import Planner, Rehearsal, predict_peak

GPT = "tests.support.factories:tiny_gpt"
SAMPLE = [((2, 16), "int32"), ((2, 16), "int32")]


@pytest.fixture(scope="module")
def planner():
    p = Planner(GPT, SAMPLE, 2)
    yield p
    p.close()


def test_the_repeated_blocks_are_found_and_cut(planner):
    net = planner.network
    assert (net.depth, net.list_name) == (4, "gpt.blocks")
    assert net.n_states == 2 and net.block_numel > 0
    from mindzero.planner.factory import build

    cut, _, lists = build(GPT, net.cut, 2)
    assert len(lists.kept) == 2 and len(cut.gpt.blocks) == 2
    assert sum(int(np.prod(p.shape)) for p in cut.get_parameters()) == \
        sum(int(np.prod(p.shape)) for p in planner.network.net.get_parameters()) - 2 * net.block_numel


def test_the_prediction_extrapolates_the_rehearsals_and_its_parts_add_up(planner):
    pred = planner.predict({"zero_stage": 2})
    ms = planner.measure([({"zero_stage": 2}, d, 2, False) for d in planner.depths])
    assert all(m.peak > 50 * MIB for m in ms), "a compiled step costs a rank tens of MiB at least"
    assert pred.fit.peak(1, 2) == pytest.approx(ms[0].peak) and pred.fit.peak(2, 2) == pytest.approx(ms[1].peak)
    assert pred.peak == pytest.approx(pred.fit.peak(4, 2)) and pred.peak > ms[1].peak
    assert sum(pred.parts.values()) == pytest.approx(pred.peak)
    est = mindzero.estimate_memory(planner.network.net, 2, 2, n_states=2)
    assert pred.parts["model_states"] == est["total"]


def test_stage_3_takes_off_what_the_rehearsal_kept_that_a_run_regathers(planner):
    """The fit of stage 3 with re-gather passes through the smallest replica and, per block above it, the
    replicas' growth less what the rehearsal kept (mindzero.core.fit.kept_gathers_per_block: the block's
    gathered bytes less the saving its memory pool shows against the same replicas without re-gather)."""
    from mindzero.core.fit import kept_gathers_per_block

    opts, plain = {"zero_stage": 3}, {"zero_stage": 3, "stage3_regather": False}
    ms = planner.measure([(opts, d, 2, False) for d in planner.depths])
    flat = planner.measure([(plain, d, 2, False) for d in planner.depths])
    kept = kept_gathers_per_block(ms, flat, planner.network.gathered_bytes(opts))
    assert 0 <= kept <= planner.network.block_bytes == planner.network.block_numel * 4
    fit = planner.predict(opts).fit
    assert fit.peak(1, 2) == pytest.approx(ms[0].peak)
    assert fit.peak(2, 2) == pytest.approx(ms[1].peak - kept)
    assert planner.predict(plain).fit.peak(2, 2) == pytest.approx(flat[1].peak), "no re-gather: nothing kept"


def test_the_wire_bytes_extrapolate_exactly_to_the_full_networks_plan(planner):
    """Every block adds the same collectives: two replicas' traffic, extrapolated to 4 blocks, is the full
    network's (rehearsed whole: its plan's real collectives)."""
    pred = planner.predict({"zero_stage": 2})
    whole = Planner(GPT, SAMPLE, 2, Rehearsal(depths=(1, 4)))
    try:
        full, = whole.measure([({"zero_stage": 2}, 4, 2, False)])
    finally:
        whole.close()
    assert full.traffic > 0 and pred.wire_bytes == pytest.approx(full.traffic, rel=1e-9)


def test_a_network_without_repeated_blocks_is_rehearsed_whole():
    pred = predict_peak("tests.support.factories:no_blocks", [((8, 32), "float32"), ((8, 8), "float32")], 2, 2)
    assert pred.depth is None and pred.peak > 0 and len(BlockLists().found) == 0


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="top level"):
        factory_ref(lambda: None)
    with pytest.raises(ValueError, match="module:function"):
        factory_ref("no_colon")
    with pytest.raises(ValueError, match="sample item"):
        predict_peak(GPT, [(2, 16)], 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        predict_peak(GPT, SAMPLE, 0)
    with pytest.raises(RuntimeError, match="fails on purpose"):
        Planner("tests.support.factories:broken", SAMPLE, 2)
    with pytest.raises(TypeError, match=r"must return \(net_with_loss, optimizer\)"):
        Planner("tests.support.factories:not_a_pair", SAMPLE, 2)
    with pytest.raises(ValueError, match="unknown option 'bogus'"):  # before any rehearsal
        predict_peak(GPT, SAMPLE, 2, zero_stage=3, bogus=1)
    with pytest.raises(ValueError, match="gather_quantization='int8' needs zero_stage=3"):
        predict_peak(GPT, SAMPLE, 2, zero_stage=2, gather_quantization="int8")
    with pytest.raises(ValueError, match=r"depths=\(2, 2\): two block counts"):
        Rehearsal(depths=(2, 2))
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        Rehearsal(jobs=0)
    with pytest.raises(ValueError, match="plan: unknown argument 'jobs'"):
        mindzero.plan(GPT, SAMPLE, 2, "4GiB", jobs=2)
    with pytest.raises(ValueError, match=r"margin=1.5: must be a fraction in \[0, 1\)"):
        mindzero.plan(GPT, SAMPLE, 2, "4GiB", margin=1.5)
    with pytest.raises(ValueError, match="no configuration fits; the smallest predicted peak is"):
        mindzero.plan(GPT, SAMPLE, 2, "1MiB", stages=(0,))  # two rehearsals, of stage 0


def test_a_failing_rehearsal_reports_its_error(planner):
    with pytest.raises(RuntimeError, match="zero_stage"):
        planner.measure([({"zero_stage": 7}, 1, 2, False)])


def test_the_cli_prints_the_table_and_a_recommendation(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mindzero.planner.cli", GPT, "--sample", "2x16:int32,2x16:int32",
                          "--world-size", "2", "--budget", "4GiB", "--stages", "2,3", "--no-quantization",
                          "--global-batch", "4", "--json", str(tmp_path / "plan.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "| stage 2 |" in text and "| stage 3, no regather |" in text and "accumulate 2" in text
    assert "recommended: stage 2" in text, text  # the least traffic: stage 3 gathers too
    assert "largest depth within the budget" in text
    import json
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["best"].startswith("stage 2") and len(saved["predictions"]) >= 6

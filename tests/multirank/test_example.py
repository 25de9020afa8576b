"""The README's example (examples/train_gpt.py) at CI size, on 2 ranks: every stage equals plain data
parallel bit for bit, as the main job's table says; checkpoints are kept and pruned, the merged model loads into the plain network and
generates, a loss curve is drawn, and an interrupted run resumes to the same losses."""
import json
from pathlib import Path

import pytest

import mindzero
from mindzero.checkpoint.tensor_io import open_reader
from mindzero.launch.local import LaunchError, msrun
from mindzero.launch.logs import rank_output

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = REPO / "examples" / "train_gpt.py"
CONFIG = HERE / "configs" / "gpt_tiny.yaml"


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("example")
    msrun(SCRIPT, 2, out, ["--config", CONFIG], timeout=900)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Stage 2 stopped after step 4 (newest checkpoint: step 3), then started again on the same --out."""
    out = tmp_path_factory.mktemp("example_resume")
    msrun(SCRIPT, 2, out, ["--config", CONFIG, "--stage", "2", "--stop-after", "4"], timeout=900)
    first = rank_output(out, 0)
    msrun(SCRIPT, 2, out, ["--config", CONFIG, "--stage", "2"], timeout=900)
    return out, first, rank_output(out, 0)


def test_every_stage_equals_plain_dp(full):
    """What the main job's table claims (the tiny config is the main job's, smaller): plain data parallel
    (MindSpore's nn.TrainOneStepCell) runs first, and every stage equals it bit for bit, in every loss and
    every final parameter; the table prints those differences and says so."""
    results = json.loads((full / "results.json").read_text())
    assert list(results) == ["dp", "0", "1", "2", "3"]
    ref = results["dp"]["losses"]
    assert len(ref) == 6 and ref[-1] < ref[0], ref
    for stage in "0123":
        assert results[stage]["losses"] == ref, stage
        assert results[stage]["loss_diff"] == 0.0 and results[stage]["param_diff"] == 0.0, results[stage]
    log = rank_output(full, 0)
    table = [line for line in log.splitlines() if line.startswith("| plain DP |") or line.startswith("| stage ")]
    assert [line.split(" | ")[:4] for line in table] == [
        [f"| {name}", f"{ref[-1]:.6f}", "0.0e+00", "0.0e+00"] for name in
        ("plain DP", "stage 0", "stage 1", "stage 2", "stage 3")], table
    assert "Every stage equals plain DP bit for bit: every loss and every final parameter." in log


def test_run_outputs(full):
    for stage in range(4):
        run = full / f"stage_{stage}"
        ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert ckpts == ["step_000006"], ckpts  # keep_checkpoints: 1 pruned step 3
        assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert [h["step"] for h in json.loads((run / "history.json").read_text())] == [1, 2, 3, 4, 5, 6]
        sample = (run / "samples.txt").read_text()
        assert sample.startswith("the ") and len(sample.rstrip("\n")) == 4 + 20, sample
        names = set(open_reader(run / "final_model.ckpt").names())
        assert "gpt.embed.embedding_table" in names and not any(n.startswith(("adam_", "zero")) for n in names)
    log = rank_output(full, 0)
    for needle in ("stage 3: 2 ranks, op group 2", "memory plan per rank", "step     6/6 (100%) loss",
                   "scale 1 overflow False tokens/s", "greedy sample"):
        assert needle in log, needle
    assert (full / "loss_all_stages.png").exists()


def test_resume_continues_exactly(full, resumed):
    out, first, second = resumed
    assert "stopping after step 4" in first and "step     6/6" not in first
    assert "resumed from" in second and "step_000003 at step 3" in second
    want = json.loads((full / "results.json").read_text())["2"]["losses"]
    got = json.loads((out / "results.json").read_text())["2"]["losses"]
    assert got == want, (got, want)  # same data position, same state: bit-identical


def test_no_resume_refuses_existing_checkpoints(resumed, tmp_path):
    out = resumed[0]
    with pytest.raises(LaunchError, match="already holds checkpoints and --no-resume was given"):
        msrun(SCRIPT, 2, out, ["--config", CONFIG, "--stage", "2", "--no-resume"], timeout=300,
              env={"MS_NODE_TIMEOUT": "10"})


MODEL_SCRIPT = REPO / "examples" / "train_with_model.py"
MODEL_CONFIG = HERE / "configs" / "gpt_model_tiny.yaml"


@pytest.fixture(scope="module")
def with_model(tmp_path_factory):
    """examples/train_with_model.py from its config: stopped after step 6, then run again on the same --out."""
    out = tmp_path_factory.mktemp("example_model")
    msrun(MODEL_SCRIPT, 2, out, ["--config", MODEL_CONFIG, "--out", out, "--stop-after", "6"], timeout=900)
    first = rank_output(out, 0)
    msrun(MODEL_SCRIPT, 2, out, ["--config", MODEL_CONFIG, "--out", out], timeout=900)
    return out, first, rank_output(out, 0)


def test_model_example_stops_resumes_and_merges(with_model):
    """Model.train with ZeroCheckpoint from the config file (stage 3, accumulation 2, checkpoints every 4
    steps, 2 kept): the second launch resumes at step 6 and finishes epoch 2; LossMonitor and TimeMonitor
    print; the merged model loads into the plain network; each launch ends with a summary line."""
    import mindspore as ms

    out, first, second = with_model
    assert "ZeRO stage 3 on 2 ranks, 2 epochs x 10 steps" in first and "from scratch" in first
    assert "stopping after step 6" in first and "done: step 6/20" in first
    assert "resumed at step 6 (epoch 1)" in second and "done: step 20/20" in second
    assert "epoch: 1 step: 5, loss is" in first and "epoch: 2 step: 7, loss is" in second  # LossMonitor(5)
    assert "per step time" in first and "per step time" in second
    assert sorted(p.name for p in (out / "ckpts").iterdir()) == ["step_00000016", "step_00000020"]
    state = mindzero.read_trainer_state(out / "ckpts" / "step_00000020")
    assert state["step"] == 20 and [s for s, _ in state["history"]] == list(range(1, 21))
    assert state["history"][-1][1] < state["history"][0][1]
    from examples.gpt import GPT, LMLoss

    params = ms.load_checkpoint(str(out / "final_model.ckpt"))
    missing, unused = ms.load_param_into_net(LMLoss(GPT(len(params["gpt.embed.embedding_table"]), 32, 1, 2, 16)),
                                             params, strict_load=True)
    assert not missing and not unused

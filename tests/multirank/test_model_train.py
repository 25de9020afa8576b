"""Training through ``mindspore.train.Model`` on 2 ranks (one msrun launch, ``worker_model.py``): at stages
0 and 3, ``Model.train`` over a sharded ``GeneratorDataset`` equals the hand-written loop exactly, and an
interrupted ``Model.train`` restarted through ``mindzero.ZeroCheckpoint`` (settings from a config file)
equals the uninterrupted run exactly."""
import json
import numpy as np
import pytest

from mindzero.launch.local import msrun
from mindzero.launch.logs import rank_output
from tests.support.compare import load_npz

from . import WORKERS
N, STAGES, STEPS = 2, (0, 3), 30


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_train")
    msrun(WORKERS / "worker_model.py", N, out, ["--stages", ",".join(map(str, STAGES))], timeout=900)
    return out


def load(out, rank, stage):
    arrays = load_npz(out / f"rank_{rank}" / f"stage{stage}.npz")
    return arrays, json.loads((out / f"rank_{rank}" / f"stage{stage}.json").read_text())


def params(arrays, prefix):
    return {k[len(prefix) + 1:]: v for k, v in arrays.items() if k.startswith(prefix + "/")}


@pytest.mark.parametrize("stage", STAGES)
def test_model_train_equals_the_loop(out, stage):
    """Losses of all 30 steps and every final parameter, bit for bit, on each rank (stage 0 asked for
    dataset_sink_mode=True, which MindSpore runs without sink on CPU)."""
    for r in range(N):
        a, _ = load(out, r, stage)
        loop = a["loop_losses"]
        assert len(loop) == STEPS and loop[-1] < 0.5 * loop[0], loop  # it trains
        np.testing.assert_array_equal(a["model_losses"], loop, err_msg=f"rank {r}")
        ref = params(a, "loop")
        assert len(ref) == 16
        for k, v in params(a, "model").items():
            np.testing.assert_array_equal(v, ref[k], err_msg=f"rank {r} {k}")
    # the ranks train on different shards of the data
    assert not np.array_equal(load(out, 0, stage)[0]["loop_losses"], load(out, 1, stage)[0]["loop_losses"])


@pytest.mark.parametrize("stage", STAGES)
def test_interrupted_and_resumed_equals_uninterrupted(out, stage):
    """Crashed at step 14 (checkpoints every 4 steps, 2 kept: 8 and 12), restarted: resumed at step 12,
    with the callback written in every form (stage 0: ``ZeroCheckpoint(directory, save_every=, keep=)``, then
    ``ZeroCheckpoint(directory, config=CheckpointConfig(...))``; stage 3: the settings file, then the network
    first),
    in the middle of epoch 2 (Model reports steps 13..30), loss history (the checkpoint's 12 and 18 new)
    and final parameters equal the uninterrupted loop's, on each rank."""
    for r in range(N):
        a, meta = load(out, r, stage)
        assert meta["first_run_steps"] == list(range(1, 15))
        assert meta["after_crash"] == ["step_00000008", "step_00000012"]
        assert meta["initial_epoch"] == 1
        # ZeroCheckpoint(directory) / (directory, config=CheckpointConfig): resume() had no network and
        # loaded the checkpoint when Model.train began; made with the network, it loaded at once
        assert meta["loaded_at_resume"] == (stage == 3)
        assert a["resumed_steps"].tolist() == list(range(13, STEPS + 1))
        assert a["resumed_history_steps"].tolist() == list(range(1, STEPS + 1))
        np.testing.assert_array_equal(a["resumed_losses"], a["loop_losses"], err_msg=f"rank {r}")
        ref = params(a, "loop")
        resumed = params(a, "resumed")
        assert sorted(resumed) == sorted(ref)
        for k, v in resumed.items():
            np.testing.assert_array_equal(v, ref[k], err_msg=f"rank {r} {k}")
        assert meta["at_end"] == ["step_00000028", "step_00000030"]  # keep=2, final save at the end
        assert meta["final_state"] == {"step": STEPS, "epoch": 3, "batch_num": 10}


def test_loss_monitor_prints_the_loss(out):
    """MindSpore's LossMonitor sees the train step's loss: every 5 steps, and after the resume with the
    continued step count (it prints first at global step 13 = epoch 2 step 3, its own count starting
    at 0, then every 5 steps)."""
    text = rank_output(out, 0)
    lines = [l for l in text.splitlines() if ", loss is " in l]
    per_run = [f"epoch: {e} step: {s}, loss is" for e in (1, 2, 3) for s in (5, 10)]
    resumed = [f"epoch: {e} step: {s}, loss is" for e in (2, 3) for s in (3, 8)]
    expected = (per_run + resumed) * len(STAGES)
    assert [l.split(" ", 5)[:5] for l in lines] == [e.split(" ", 5)[:5] for e in expected], lines
    assert all(np.isfinite(float(l.rsplit(" ", 1)[1])) for l in lines)

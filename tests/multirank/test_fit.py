"""mindzero.predict_peak against real 2-rank launches: the rehearsal's prediction for two configurations of a
small GPT (stage 0 and stage 3) within 15% of the highest rank's measured peak (CI's bound, generous for a busy
machine: benchmarks/fit_accuracy.py holds 10% on a quiet one, docs/performance.md). Each configuration is its own
launch of ``benchmarks/fit_worker.py`` (the network built under ``lazy_init`` as the planner builds it, three
steps), so each process's memory is that configuration's alone."""
import json
import sys
from pathlib import Path

import pytest

from mindzero.launch.local import msrun
from mindzero.planner.planner import Planner, Rehearsal

from . import WORKERS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fit_worker import launch  # noqa: E402  (the worker the benchmark launches, and its launcher)

N = 2
GPT = "tests.support.factories:tiny_gpt"
KWARGS = dict(vocab=4096, dim=256, layers=6, heads=8, seq=32)
SAMPLE = [((2, 32), "int32"), ((2, 32), "int32")]
BOUND = 0.15


@pytest.fixture(scope="module")
def planner():
    p = Planner(GPT, SAMPLE, N, Rehearsal(factory_kwargs=KWARGS))
    yield p
    p.close()


# stage 0 in the full tier: stage 3's prediction has every part stage 0's has and the gathers besides
@pytest.mark.parametrize("options", [pytest.param({"zero_stage": 0}, marks=pytest.mark.full), {"zero_stage": 3}],
                         ids=["stage0", "stage3"])
def test_the_predicted_peak_is_within_15_percent_of_a_real_launch(planner, options, tmp_path):
    pred = planner.predict(options)
    spec = dict(factory=GPT, factory_kwargs=KWARGS, options=options, batch=planner.batch, steps=3,
                sample=planner.sample)
    peaks = [r["peak"] for r in launch(spec, N, tmp_path, timeout=600)]
    measured = max(peaks)
    assert measured > 100 * 2 ** 20, peaks  # a compiled step: not an empty measurement
    assert abs(pred.peak / measured - 1) <= BOUND, (pred.peak / 2 ** 20, measured / 2 ** 20, pred.parts)


def test_a_training_script_asks_predict_peak_about_its_own_factory_under_msrun(tmp_path):
    """From inside a 2-rank msrun launch, after ``init()``: a script with unguarded top-level code (its argument
    parsing, ``init()``) is refused on every rank before any rehearsal, naming the line and the remedies; a guarded
    one gets a prediction (its rehearsals, fresh processes without the launch's cluster variables, do not join
    the running job)."""
    script = WORKERS / "script_plan_unguarded.py"
    line = script.read_text().splitlines().index("parser = argparse.ArgumentParser()") + 1
    out = msrun(script, N, tmp_path / "unguarded", timeout=600)
    for r in range(N):
        got = json.loads((out / f"rank_{r}.json").read_text())
        assert "refused" in got, got
        assert f"which runs code at its top level (line {line}: 'parser = argparse.ArgumentParser()'" in got["refused"]
        assert "Define the factory in a module the script imports" in got["refused"]
    out = msrun(WORKERS / "script_plan_guarded.py", N, tmp_path / "guarded", timeout=900)
    got = json.loads((out / "rank_0.json").read_text())
    assert got["peak"] > 0 and got["states"] > 0, got

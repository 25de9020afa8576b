"""mindzero.predict_peak against real 2-rank launches: the rehearsal's prediction for two configurations of a
small GPT (stage 0 and stage 3) within 15% of the highest rank's measured peak (CI's bound, generous for a busy
machine: benchmarks/fit_accuracy.py holds 10% on a quiet one, docs/performance.md). Each configuration is its own
launch of ``benchmarks/fit_worker.py`` (the network built under ``lazy_init`` as the planner builds it, three
steps), so each process's memory is that configuration's alone."""
import sys
from pathlib import Path

import pytest

from mindzero.engine.fit import Planner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fit_worker import launch  # noqa: E402  (the worker the benchmark launches, and its launcher)

N = 2
GPT = "tests.support.factories:tiny_gpt"
KWARGS = dict(vocab=4096, dim=256, layers=6, heads=8, seq=32)
SAMPLE = [((2, 32), "int32"), ((2, 32), "int32")]
BOUND = 0.15


@pytest.fixture(scope="module")
def planner():
    p = Planner(GPT, SAMPLE, N, factory_kwargs=KWARGS)
    yield p
    p.close()


@pytest.mark.parametrize("options", [{"zero_stage": 0}, {"zero_stage": 3}], ids=["stage0", "stage3"])
def test_the_predicted_peak_is_within_15_percent_of_a_real_launch(planner, options, tmp_path):
    pred = planner.predict(options)
    spec = dict(factory=GPT, factory_kwargs=KWARGS, options=options, batch=planner.batch, steps=3,
                sample=planner.sample)
    peaks = [r["peak"] for r in launch(spec, N, tmp_path, timeout=600)]
    measured = max(peaks)
    assert measured > 100 * 2 ** 20, peaks  # a compiled step: not an empty measurement
    assert abs(pred.peak / measured - 1) <= BOUND, (pred.peak / 2 ** 20, measured / 2 ** 20, pred.parts)

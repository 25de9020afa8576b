"""Comparing runs: what a launch wrote (:class:`Results`), relative errors, and :func:`assert_same_run`."""
import json
import os
from pathlib import Path

import numpy as np

RTOL = 1e-5  # fp32 parity between stages and with plain data parallel (mostly exact; docs/parity.md)
# a step's local loss of two runs whose parameters are bit-identical: measured 1 ulp apart at one step of 20
# now and then (6.6e-8 relative; the same graph math, a different graph around it)
LOSS_NOISE = 1e-6
# fp16 has an 11-bit significand: one unit in the last place is 2^-10 = 9.8e-4 relative. Stages add fp16 values in
# another order where the data flow differs (a tied weight's two gradients summed before or after the reduction;
# accumulation before or after it), so parity is held to fp16 rounding.
RTOL_FP16 = 1e-3  # measured (2 / 4 ranks): exact, except the tied embedding at stage 3: 5.2e-4 / 3.8e-4
RTOL_FP16_ACCUM = 1e-2  # measured (K=4, fp16 buffers): 3.1e-3 / 5.6e-3 at stages 2-3 (reduce, then accumulate)
# CAME divides each update by its factored row/column statistics, so the fp32 rounding of a micro-batch sum taken in
# another order (stages 2-3 reduce each micro-batch, then add) grows over the steps: 1.36e-5 after 10 steps at 2 ranks
RTOL_OWNER_ACCUM = 1e-4
# ... and grows from step to step: at 4 ranks 3.5e-6 after the first update, 1.1e-4 after the third, 1e-1 after the
# tenth; stages 2-3 are held to stage 0 over the first updates (and to each other bit for bit)
OWNER_ACCUM_EARLY_UPDATES = 2
RTOL_FP16_VS_FP32 = 2e-2  # the losses of fp16 vs fp32 training, 20 steps; measured 8.2e-3 / 4.4e-3
# scripts/verify_accelerator.sh runs the tests on GPU/Ascend: there every scenario takes the real path
ON_CPU = os.environ.get("MINDZERO_DEVICE", "CPU") == "CPU"


class Results:
    """The files one launch wrote (``<out>/rank_<r>/<name>.npz``) and the :class:`~tests.support.scenarios.Scenario`
    records it ran. A test reads only scenarios its launch ran (the collection hook deselects the others:
    :func:`tests.support.tier.deselect`); asking for any other name fails."""

    def __init__(self, out, scenarios):
        self.out, self.scenarios = Path(out), {s.name: s for s in scenarios}

    def scenario(self, name: str):
        if name not in self.scenarios:
            raise AssertionError(f"scenario {name!r} is not in this launch's matrix (a misspelt name, or a test the "
                                 f"collection should have deselected); it ran {sorted(self.scenarios)}")
        return self.scenarios[name]

    def load(self, rank: int, name: str) -> dict:
        self.scenario(name)
        return load_npz(self.out / f"rank_{rank}" / f"{name}.npz")

    def json(self, rank: int, name: str):
        return json.loads((self.out / f"rank_{rank}" / name).read_text())


def load_npz(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)) if b.size else 0.0


def assert_same_run(got, ref, what, rtol=RTOL, loss_rtol=None, overflow=False):
    """Two runs' losses (where the reference is finite; every one unless ``overflow``: the scenario forces one)
    within ``loss_rtol`` (default ``rtol``) and every final parameter (``param/...``) within ``rtol`` relative
    (0: bit for bit)."""
    assert len(got["losses"]) == len(ref["losses"]) >= 10, what
    assert overflow or np.all(np.isfinite(ref["losses"])), f"{what}: a loss is not finite in a run without a forced overflow"
    finite = np.isfinite(ref["losses"])
    err = rel_err(got["losses"][finite], ref["losses"][finite])
    bound = rtol if loss_rtol is None else loss_rtol
    assert err <= bound, f"{what}: losses differ by {err:.2e} relative\n{got['losses']}\n{ref['losses']}"
    names = sorted(k for k in ref if k.startswith("param/") and not k.endswith("@init"))
    assert names == sorted(k for k in got if k.startswith("param/") and not k.endswith("@init")), \
        f"{what}: parameter names differ"
    for k in names:
        assert got[k].shape == ref[k].shape, f"{what}: {k} shape {got[k].shape} != {ref[k].shape}"
        err = rel_err(got[k], ref[k])
        assert err <= rtol, f"{what}: {k} differs by {err:.2e} relative"


def assert_parity_checks(res: Results, n: int) -> None:
    """The checks every parity launch makes besides training (``worker_parity.py``): the collective Cells
    against numpy on this world; a plan that differs on the last rank refused on every rank, naming the
    parameter, instead of a deadlock; and so are ranks on different devices or collective backends, naming each
    rank's."""
    for r in range(n):
        c = res.json(r, "collectives.json")
        assert c == dict(reduce_scatter_ok=True, all_gather_ok=True, any_rank_last=True, any_rank_none=False), (r, c)
        message = (res.out / f"rank_{r}" / "plan_mismatch.txt").read_text()
        assert f"rank {r}: the networks differ across ranks at parameter #" in message, (r, message)
        assert "'proj' (15, " in message and f"rank {n - 1} differs from rank 0" in message, (r, message)
        devices = res.json(r, "device_mismatch.json")
        on = ", ".join(f"rank {k} on {'GPU' if k == n - 1 else 'CPU'}" for k in range(n))
        assert devices["device"] == (f"rank {r}: the ranks run on different devices ({on}); every rank must run on "
                                     "the same device: set it the same way on each (mindspore.set_device, or "
                                     "start_data_parallel(device=...) / MINDZERO_DEVICE)"), (r, devices)
        on = ", ".join(f"rank {k} on {'substitute' if k == n - 1 else 'emulated'}" for k in range(n))
        assert devices["backend"].startswith(f"rank {r}: the ranks run on different collective backends ({on}); "
                                             "every rank must run on the same collective backend: turn the test-only "
                                             "substitute"), (r, devices)

"""One rehearsal: a replica of the user's network (some of its repeated blocks) built under ``lazy_init`` and
prepared by ``prepare_train_network`` as world rank 0 of ``N`` (:func:`mindzero.comm.groups.rehearse`), two steps
run on an example batch, in a process of its own (a fresh interpreter with the launcher's
``MALLOC_MMAP_THRESHOLD_``, and none of a launch's cluster environment), so its peak RSS above the RSS before
building is its alone, as a rank's in a launch.

``python -m mindzero.planner.rehearse SPEC.json RESULT.json`` is that process.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..core.fit import MIB, Measurement
from ..core.host import reset_peak, status_kib
from .factory import build, load_factory

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
STEPS = 2  # steps each rehearsal runs: the first compiles, the second is a steady step
MICRO_PHASES = ("forward", "backward")  # collectives every micro-step repeats (mindzero.core.comm_plan.Call.phase)
# what a launch puts in its processes' environment to join its cluster (msrun, mindzero.launch.mpi, mpirun,
# Slurm): a rehearsal started from inside a launched script must not see it, or it would join the running job
CLUSTER_VARIABLES = ("MS_ROLE", "MS_WORKER_NUM", "MS_NODE_ID", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_TIMEOUT",
                     "MS_TOPO_TIMEOUT", "MS_RECEIVE_MSG_TIMEOUT", "MS_ENABLE_RECOVERY", "MS_RECOVERY_PATH",
                     "MS_HCCL_CM_INIT", "MS_LOCAL_WORKER", "RANK_ID", "RANK_SIZE", "DEVICE_ID", "LOCAL_RANK",
                     "RANK_TABLE_FILE", "MINDSPORE_HCCL_CONFIG_PATH")
CLUSTER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def rehearsal_env(env) -> dict:
    """``env`` without a launch's cluster variables (:data:`CLUSTER_VARIABLES`, :data:`CLUSTER_PREFIXES`)."""
    return {k: v for k, v in env.items() if k not in CLUSTER_VARIABLES and not k.startswith(CLUSTER_PREFIXES)}


def example_batch(sample, batch: int, seed: int = 0) -> list:
    """The example inputs at micro-batch ``batch`` (dimension 0): arrays repeated or cut row-wise; shapes
    filled (integers 0, floats standard normal)."""
    rng = np.random.RandomState(seed)
    out = []
    for item in sample:
        if isinstance(item, dict) and "array" in item:
            arr = np.asarray(item["array"])
            out.append(arr[np.arange(batch) % arr.shape[0]])
            continue
        shape, dtype = (batch, *item["shape"][1:]), np.dtype(item["dtype"])
        out.append(rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype))
    return out


def rehearse_one(spec: dict) -> dict:
    """Rehearse one replica (``spec``: factory, world_size, options, cut, depth, batch, sample, recompute) and
    return its measurement. Runs in a fresh process (:func:`run_child`)."""
    import mindspore as ms
    from mindspore import Tensor

    from ..comm.groups import rehearse
    from ..core.comm_plan import summarize
    from ..core.memory import KINDS
    from ..engine.prepare import prepare_train_network
    from ..engine.report import memory_report

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    load_factory(spec["factory"])  # its imports belong to the baseline, not to the network
    sample = spec["sample"]
    if spec.get("arrays"):
        loaded = np.load(spec["arrays"])
        sample = [{"array": loaded[f"a{i}"]} for i in range(len(loaded.files))]
    inputs = [Tensor(a) for a in example_batch(sample, spec["batch"])]
    rss0 = status_kib("VmRSS")
    reset_peak()
    t = time.perf_counter()
    net, opt, lists = build(spec["factory"], spec.get("cut"), spec.get("depth"), spec.get("factory_kwargs"))
    if spec.get("recompute") and lists.kept is not None:
        for cell in lists.kept:
            cell.recompute()
    with rehearse(spec["world_size"]):
        train = prepare_train_network(net, opt, **spec["options"])
    for _ in range(STEPS):
        out = train(*inputs)
        out[0].asnumpy()
    peak = (status_kib("VmHWM") - rss0) * 1024
    report = memory_report(train)
    calls = train.zero_info.real_calls
    return dict(peak=peak, states=sum(report[k] for k in KINDS), traffic=summarize(calls)["total"]["traffic"],
                micro_traffic=summarize([c for c in calls if c.phase in MICRO_PHASES])["total"]["traffic"],
                seconds=time.perf_counter() - t, depth=spec.get("depth"), batch=spec["batch"])


def run_child(spec: dict, timeout: float) -> Measurement:
    """One rehearsal in a fresh interpreter (:func:`rehearse_one`), outside any launch (:func:`rehearsal_env`)."""
    with tempfile.TemporaryDirectory(prefix="mindzero_fit_") as tmp:
        src, dst = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        src.write_text(json.dumps(spec))
        env = dict(rehearsal_env(os.environ), MALLOC_MMAP_THRESHOLD_="1048576", GLOG_v="3",
                   MS_DEV_RUNTIME_CONF="memory_statistics:True",
                   PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, *sys.path[1:], os.environ.get("PYTHONPATH", "")]))
        try:
            run = subprocess.run([sys.executable, "-m", "mindzero.planner.rehearse", str(src), str(dst)],
                                 env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"rehearsal of {spec['factory']} (depth {spec.get('depth')}, batch {spec['batch']}, "
                               f"{spec['options']}) took more than {timeout:.0f} s") from None
        if run.returncode != 0 or not dst.exists():
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"rehearsal of {spec['factory']} (depth {spec.get('depth')}, batch {spec['batch']}, "
                               f"options {spec['options']}) failed (exit {run.returncode}):\n{tail}")
        r = json.loads(dst.read_text())
    return Measurement(r["depth"] or 0, r["batch"], r["peak"], r["states"], r["traffic"], r["seconds"],
                       r["micro_traffic"], pool_peak(run.stdout + run.stderr))


_POOL = re.compile(r"dynamic memory pool .*?actual peak used mem:(\d+)M")


def pool_peak(log: str) -> int:
    """Bytes: the highest "actual peak used mem" of MindSpore's dynamic memory pool in a log written under
    ``MS_DEV_RUNTIME_CONF=memory_statistics:True`` (printed in MiB; 0 if absent)."""
    return max([int(x) for x in _POOL.findall(log)] or [0]) * MIB


def main(argv=None) -> int:
    spec_path, result_path = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(spec_path).read_text())
    Path(result_path).write_text(json.dumps(rehearse_one(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

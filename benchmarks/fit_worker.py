"""One measured run for ``fit_accuracy.py`` and ``tests/multirank/test_fit.py`` (launched by msrun on every rank):
the factory's network built under ``mindzero.lazy_init`` and prepared with the given options, a few steps on the
sample's shapes, in the real world this process joined; writes ``<out>/rank_<r>.json`` with the peak RSS above the RSS right before building (after
``init()`` and the imports: what ``mindzero.predict_peak`` predicts). :func:`launch` starts it and reads the peaks."""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def launch(spec: dict, world: int, out: Path, timeout: float, reuse: bool = False) -> list:
    """Every rank's result of one launch of this worker with ``spec`` (``reuse``: an earlier launch's under ``out``)."""
    from mindzero.launch.local import msrun

    out = Path(out)
    if not (reuse and all((out / f"rank_{r}.json").exists() for r in range(world))):
        msrun(Path(__file__), world, out, args=["--spec", json.dumps(spec)], timeout=timeout)
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--spec", required=True, help="JSON: factory, factory_kwargs, options, sample, batch, steps")
    a = ap.parse_args()
    spec = json.loads(a.spec)
    import mindspore as ms
    from mindspore import Tensor

    import mindzero
    from mindzero.core.host import reset_peak, status_kib
    from mindzero.planner.factory import build, load_factory
    from mindzero.planner.rehearse import example_batch

    world = mindzero.start_data_parallel()
    ms.set_seed(0)
    load_factory(spec["factory"])
    inputs = [Tensor(x) for x in example_batch(spec["sample"], spec["batch"], seed=world.world_rank)]
    rss0 = status_kib("VmRSS")
    reset_peak()
    t = time.perf_counter()
    net, opt, lists = build(spec["factory"], kwargs=spec.get("factory_kwargs"))
    if spec.get("recompute"):
        for cell in lists.largest()["cells"]:
            cell.recompute()
    # (as a user's script: mindzero's engine is imported here, on first use, after the baseline)
    train = mindzero.prepare_train_network(net, opt, **spec["options"])
    times = []
    for _ in range(spec.get("steps", 3)):
        s = time.perf_counter()
        out = train(*inputs)
        out[0].asnumpy()
        times.append(time.perf_counter() - s)
    peak = (status_kib("VmHWM") - rss0) * 1024
    out = Path(a.out)
    (out / f"rank_{world.world_rank}.json").write_text(json.dumps(dict(peak=peak, seconds=time.perf_counter() - t,
                                                                       times=times, rss0_kib=rss0)))
    from mindzero.launch.worker import finish_rank

    finish_rank(out, world.world_rank)


if __name__ == "__main__":
    main()

"""Stage 3's peak memory for gathered parameters, with and without re-gathering in backward.

    .venv/bin/python benchmarks/regather_bench.py [--layers 8] [--dim 1024] [--ranks 2] [--out runs/regather_bench]

Trains an MLP of ``--layers`` square fp32 layers (one layer = dim x dim x 4 bytes) at stage 3 with
``stage3_regather=True`` (the default) and ``False``, plus stage 0, and reads MindSpore's dynamic
memory pool peak (``MS_DEV_RUNTIME_CONF=memory_statistics:True``, printed at exit; CPU's memory APIs
report 0). The pool holds every temporary of the step, gathered parameters included, but not the
persistent Parameters. Prints a markdown table and writes ``results.json``.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.launch.local import msrun  # noqa: E402


def pool_peak_mib(log: str) -> float:
    found = re.findall(r"actual peak used mem:(\d+)M", log)
    if not found:
        raise RuntimeError("no memory pool statistics in the worker log (MS_DEV_RUNTIME_CONF not honoured?)")
    return float(found[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default="runs/regather_bench")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    layer_mib = a.dim * a.dim * 4 / 2 ** 20
    rows = []
    for name, extra in (("stage 0", ["--stage", "0"]), ("stage 3, keep gathered (stage3_regather=False)",
                                                        ["--no-regather"]),
                        ("stage 3, re-gather in backward (default)", [])):
        run_dir = out / re.sub(r"\W+", "_", name)
        msrun(ROOT / "benchmarks" / "regather_worker.py", a.ranks, run_dir, timeout=900,
              args=["--layers", str(a.layers), "--dim", str(a.dim), "--batch", str(a.batch), *extra],
              env={"MS_DEV_RUNTIME_CONF": "memory_statistics:True"})
        log = (run_dir / "logs" / "worker_0.log").read_text(errors="replace")
        res = json.loads((run_dir / "rank_0.json").read_text())
        rows.append(dict(config=name, pool_peak_mib=pool_peak_mib(log), step_s=statistics.median(res["times"][1:]),
                         final_loss=res["losses"][-1]))
    model_mib = layer_mib * a.layers
    print(f"MLP {a.layers} x ({a.dim} x {a.dim}) fp32: model {model_mib:.0f} MiB, largest layer {layer_mib:.0f} MiB, "
          f"{a.ranks} ranks; stage 3 gradient shards (live at the update) {model_mib / a.ranks:.0f} MiB")
    print("| configuration | memory-pool peak MiB (temporaries) | median step s | final loss |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['pool_peak_mib']:.0f} | {r['step_s']:.3f} | {r['final_loss']:.6g} |")
    (out / "results.json").write_text(json.dumps(dict(layers=a.layers, dim=a.dim, ranks=a.ranks, model_mib=model_mib,
                                                      layer_mib=layer_mib, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The memory ZeRO saves on the paths users take: the PyTorch ``ZeroRedundancyOptimizer`` tutorial's experiment,
and a matrix of optimizer x stage x eager/lazy build x fp32/fp16, on 2 ranks.

    .venv/bin/python benchmarks/optimizer_memory.py [--out runs/optimizer_memory] [--skip-matrix]

1. **The tutorial** (pytorch.org/tutorials/recipes/zero_redundancy_optimizer.html): 20 x ``Linear(2000, 2000)``,
   Adam lr 0.01, one step of MSE on ``randn(20, 2000)``, 2 ranks; it reports a peak of 1697 MB for DDP and
   1361 MB with ``ZeroRedundancyOptimizer`` (0.80x; 336 MB saved, half of Adam's 640 MB of states) and equal
   parameter sums. Here in MindSpore: 20 x ``nn.Dense(2000, 2000)`` built eagerly, ``nn.Adam``; plain DP is
   ``nn.TrainOneStepCell``; each configuration in its own launch; the peak RSS above the RSS right after
   ``init()`` (CPU: no allocator statistics; the tutorial's figure is CUDA's ``max_memory_allocated``).
2. **The matrix**: 12 x ``nn.Dense(1500, 1500)`` (27M parameters), every optimizer mindzero shards, stages 0-3,
   built eagerly or under ``mindzero.lazy_init``, fp32 or ``param_dtype=float16``: the RSS a configuration keeps
   after ``prepare_train_network`` (the step's Parameters written once, as the first step writes them) above the
   RSS before the build, next to the plan's bytes (``memory_report``'s formula: in fp32 stages 1-2 keep the
   user's full parameters and a master shard of each; with ``param_dtype`` the paper's figures).
   The tutorial's runs ``1o``-``3o`` own every layer whole (``update_sharding="owner"``), as PyTorch's
   ``ZeroRedundancyOptimizer`` partitions by parameter.

Writes ``results.json``, ``results.md`` and ``tutorial.png`` under ``--out``. Run it alone on the machine.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.launch.local import msrun  # noqa: E402

WORKER = ROOT / "benchmarks" / "optimizer_memory_worker.py"
MIB = 2 ** 20
TUTORIAL_MB = {"dp": 1697.0, "zero": 1361.0}  # the tutorial's printed peaks (MB, CUDA max_memory_allocated)
CONFIGS = ("dp", "0", "1", "2", "3", "1o", "2o", "3o")
NAMES = {"dp": "plain DP (nn.TrainOneStepCell)", "0": "stage 0", "1": "stage 1", "2": "stage 2", "3": "stage 3",
         "1o": "stage 1, owned whole", "2o": "stage 2, owned whole", "3o": "stage 3, owned whole"}
MATRIX_OPTIMIZERS = ("nn.Adam", "nn.AdamWeightDecay-groups", "nn.Momentum", "nn.SGD", "mint.optim.Adam",
                     "mint.optim.SGD")


def run_tutorial(out: Path, timeout: float) -> dict:
    results = {}
    for config in CONFIGS:
        t = time.time()
        d = out / f"tutorial_{config}"
        msrun(WORKER, 2, d, ["--job", "tutorial", "--config", config], timeout=timeout)
        results[config] = [json.loads((d / f"rank_{r}.json").read_text()) for r in range(2)]
        print(f"  tutorial {NAMES[config]}: {time.time() - t:.0f}s", flush=True)
    return results


def run_matrix(out: Path, timeout: float) -> list:
    d = out / "matrix"
    msrun(WORKER, 2, d, ["--job", "matrix", "--optimizers", ",".join(MATRIX_OPTIMIZERS), "--layers", "12",
                         "--width", "1500"], timeout=timeout)
    return json.loads((d / "rank_0.json").read_text())["rows"]


def tutorial_table(results) -> list:
    dp = results["dp"][0]["peak_above_init_mib"]
    lines = ["| run | peak above init, rank 0 / 1 (MiB) | vs plain DP | saved vs DP (MiB) | held, rank 0 (MiB) | "
             "parameter sum | tutorial (PyTorch, CUDA) |",
             "|---|---|---|---|---|---|---|"]
    for config in CONFIGS:
        r0, r1 = results[config]
        peak = r0["peak_above_init_mib"]
        theirs = {"dp": f"DDP {TUTORIAL_MB['dp']:.0f} MB", "1": f"ZeRO {TUTORIAL_MB['zero']:.0f} MB "
                  f"({TUTORIAL_MB['zero'] / TUTORIAL_MB['dp']:.2f}x, {TUTORIAL_MB['dp'] - TUTORIAL_MB['zero']:.0f} MB saved)"}
        held = "" if r0.get("held_mib") is None else f"{r0['held_mib']:.0f}"
        lines.append(f"| {NAMES[config]} | {peak:.0f} / {r1['peak_above_init_mib']:.0f} | {peak / dp:.2f}x | "
                     f"{dp - peak:.0f} | {held} | {r0['param_sum']:.6f} | {theirs.get(config, '')} |")
    return lines


def matrix_table(rows) -> list:
    lines = ["| optimizer | precision | build | stage | kept after prepare (MiB) | plan (MiB) | measured / plan |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['optimizer']} | {row['precision']} | {row['build']} | {row['stage']} | "
                     f"{row['rss_mib']:.1f} | {row['plan_mib']:.1f} | {row['rss_mib'] / row['plan_mib']:.3f} |")
    return lines


def chart(results, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    ours = [results[c][0]["peak_above_init_mib"] for c in CONFIGS]
    ax1.bar([NAMES[c].split(" (")[0].replace(", owned whole", "\nowned") for c in CONFIGS], ours,
            color=["#888"] + ["#4a7"] * 4 + ["#a74"] * 3)
    for i, v in enumerate(ours):
        ax1.text(i, v, f"{v:.0f}\n{v / ours[0]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("peak RSS above init (MiB), rank 0")
    ax1.set_title("mindzero, MindSpore CPU, 2 ranks")
    ax1.set_ylim(0, max(ours) * 1.25)
    theirs = [TUTORIAL_MB["dp"], TUTORIAL_MB["zero"]]
    ax2.bar(["DDP", "ZeroRedundancyOptimizer"], theirs, color=["#888", "#47a"])
    for i, v in enumerate(theirs):
        ax2.text(i, v, f"{v:.0f}\n{v / theirs[0]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("max memory allocated (MB)")
    ax2.set_title("PyTorch tutorial (CUDA), its printed numbers")
    ax2.set_ylim(0, max(theirs) * 1.25)
    fig.suptitle("20 x Linear(2000, 2000), Adam, one step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/optimizer_memory")
    ap.add_argument("--skip-matrix", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0)
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tutorial = run_tutorial(out, a.timeout)
    rows = [] if a.skip_matrix else run_matrix(out, a.timeout)
    phi = 12 * (1500 * 1500 + 1500)
    md = ["## The PyTorch ZeroRedundancyOptimizer tutorial's experiment (2 ranks)", "", *tutorial_table(tutorial)]
    if rows:
        worst = max(abs(r["rss_mib"] / r["plan_mib"] - 1) for r in rows)
        md += ["", f"## Memory matrix: 12 x Dense(1500, 1500), {phi / 1e6:.1f}M parameters, 2 ranks", "",
               *matrix_table(rows), "", f"largest |measured / plan - 1|: {worst:.3f}"]
    (out / "results.json").write_text(json.dumps({"tutorial": tutorial, "matrix": rows, "matrix_phi": phi}, indent=1))
    (out / "results.md").write_text("\n".join(md) + "\n")
    chart(tutorial, out / "tutorial.png")
    print("\n".join(md))
    print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}, {out / 'tutorial.png'}")


if __name__ == "__main__":
    main()

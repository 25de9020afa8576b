"""PyNative against graph mode: the first step and the steady step of plain DP and stages 0-3 in each mode.

    .venv/bin/python benchmarks/pynative.py [--models example,105m] [--configs dp,0,1,2,3] [--world 2]
        [--steps 6] [--repeats 1] [--out runs/pynative] [--phases]

One msrun launch per model, mode, configuration and repeat (``zero_bench_worker.py --mode graph|pynative``), the
modes interleaved per configuration so that the machine's drift falls on both alike. Plain DP is what MindSpore
documents for each mode: ``nn.TrainOneStepCell`` under the DATA_PARALLEL context in graph mode, ``value_and_grad``
with ``DistributedGradReducer`` in PyNative; stages 0-3 are ``mindzero.prepare_train_network`` with its defaults
(small parameters kept whole at stage 3), the same Cell in both modes.

Models: ``example`` (the first-step measurements' GPT: width 512, 6 blocks, vocabulary 512, sequence 64) and
``105m`` (zero_bench.py's GPT: width 768, 14 blocks, vocabulary 8192).

Per model, configuration and mode (rank 0, the median over the repeats): the first step (PyNative compiles nothing
ahead, graph mode compiles there) and the median steady step, each as a ratio to the same mode's plain DP; and
PyNative's steady step over graph mode's. The goal checked: each stage's PyNative ratio to PyNative plain DP at
most 1.2x its graph-mode ratio to graph-mode plain DP.

``--phases``: instead, PyNative only, each configuration's step split into its phases
(``pynative_phases_worker.py``: forward and backward; plain DP's all-reduce and update, mindzero's compiled part),
each followed by a synchronisation, beside the whole step timed as a user runs it: where the phases' sum exceeds the
whole step, they overlap.

Writes ``results.json`` and ``results.md`` under ``--out``. Needs the machine alone.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from mindzero.launch.local import msrun  # noqa: E402
from zero_bench import NAMES  # noqa: E402

MODELS = {"example": dict(dim=512, layers=6, heads=8, vocab=512, seq=64, batch=2),
          "105m": dict(dim=768, layers=14, heads=12, vocab=8192, seq=64, batch=2)}
MODES = ("graph", "pynative")
GOAL = 1.2  # PyNative's ratio to its plain DP at most this times graph mode's
PERSISTENCE = 100_000  # mindzero's default stage3_param_persistence_threshold


def model_argv(model) -> list:
    """The worker's arguments for ``model`` (``--dim 512 --layers 6 ...``)."""
    return [x for k, v in MODELS[model].items() for x in (f"--{k}", str(v))]


def run(model, mode, config, a, repeat) -> dict:
    run_dir = Path(a.out) / f"{model}_{mode}_{config}_r{repeat}"
    args = ["--config", config if config in ("dp", "0", "1", "2") else config + "p", "--mode", mode,
            "--steps", str(a.steps), "--persistence", str(PERSISTENCE),
            *model_argv(model)]
    if config != "dp":
        args.append("--lazy")
    t = time.time()
    msrun(ROOT / "benchmarks" / "zero_bench_worker.py", a.world, run_dir, args=args, timeout=a.timeout)
    print(f"  {model} {mode} {NAMES[config]} run {repeat}: {time.time() - t:.0f}s", flush=True)
    return json.loads((run_dir / "rank_0.json").read_text())


def summarize(runs: dict) -> list:
    """Rows per model and configuration: each mode's first and steady step, ratios to that mode's plain DP."""
    rows = []
    for model, by_mode in runs.items():
        med = {mode: {c: dict(first=statistics.median(r["first_step_s"] for r in rs),
                              steady=statistics.median(statistics.median(r["times"]) for r in rs),
                              losses=rs[0]["losses"]) for c, rs in by_config.items()}
               for mode, by_config in by_mode.items()}
        for config in med["graph"]:
            row = dict(model=model, config=config, name=NAMES[config])
            for mode in MODES:
                m, dp = med[mode][config], med[mode]["dp"]
                row[mode] = dict(first_s=m["first"], steady_s=m["steady"], first_ratio=m["first"] / dp["first"],
                                 steady_ratio=m["steady"] / dp["steady"], losses=m["losses"])
            row["pynative_over_graph"] = row["pynative"]["steady_s"] / row["graph"]["steady_s"]
            row["goal_ratio"] = row["pynative"]["steady_ratio"] / row["graph"]["steady_ratio"]
            row["losses_equal"] = row["pynative"]["losses"] == row["graph"]["losses"]
            rows.append(row)
    return rows


def markdown(rows: list, a) -> str:
    lines = [f"{a.world} ranks, {a.steps} steady steps after the first, {a.repeats} launch(es) per cell; rank 0's "
             "seconds; ratios to the same mode's plain DP.", "",
             "| model | configuration | graph: first step | graph: steady | PyNative: first step | PyNative: steady | "
             "PyNative / graph, steady | PyNative ratio / graph ratio | losses equal across modes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        g, p = r["graph"], r["pynative"]
        lines.append(f"| {r['model']} | {r['name']} | {g['first_s']:.2f} s ({g['first_ratio']:.2f}x) | "
                     f"{g['steady_s']:.3f} s ({g['steady_ratio']:.2f}x) | {p['first_s']:.2f} s ({p['first_ratio']:.2f}x) "
                     f"| {p['steady_s']:.3f} s ({p['steady_ratio']:.2f}x) | {r['pynative_over_graph']:.2f}x | "
                     f"{r['goal_ratio']:.2f} | {'yes' if r['losses_equal'] else 'no'} |")
    missed = [r for r in rows if r["config"] != "dp" and r["goal_ratio"] > GOAL]
    lines += ["", f"Goal: every stage's PyNative ratio at most {GOAL}x its graph-mode ratio: "
              + ("met" if not missed else "missed by " + ", ".join(f"{r['model']} {r['name']} ({r['goal_ratio']:.2f})"
                                                                    for r in missed))]
    return "\n".join(lines)


def phases(models, configs, a) -> None:
    """``--phases``: per model and configuration one launch of ``pynative_phases_worker.py``; both ranks' medians."""
    rows = []
    for model in models:
        for config in configs:
            run_dir = Path(a.out) / f"phases_{model}_{config}"
            t = time.time()
            msrun(ROOT / "benchmarks" / "pynative_phases_worker.py", a.world, run_dir, timeout=a.timeout,
                  args=["--config", config, "--steps", str(a.steps),
                        *model_argv(model)])
            print(f"  {model} {NAMES[config]} phases: {time.time() - t:.0f}s", flush=True)
            ranks = [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(a.world)]
            rows.append(dict(model=model, config=config, name=NAMES[config], ranks=ranks))
    lines = [f"PyNative, {a.world} ranks, {a.steps} whole and {a.steps} split steps; seconds, rank 0 / rank 1 "
             "(medians).", "",
             "| model | configuration | whole step | forward + backward | all-reduce | update (mindzero: the compiled "
             "part) | phases summed |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def both(get):
            return " / ".join(f"{get(k):.2f}" for k in r["ranks"])
        lines.append(f"| {r['model']} | {r['name']} | {both(lambda k: k['whole_s'])} | "
                     f"{both(lambda k: k['phases_s']['forward_backward'])} | {both(lambda k: k['phases_s']['reduce'])}"
                     f" | {both(lambda k: k['phases_s']['update'])} | {both(lambda k: k['phases_sum_s'])} |")
    out = Path(a.out)
    (out / "results.json").write_text(json.dumps(dict(world=a.world, steps=a.steps, phases=rows), indent=1))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="example,105m")
    ap.add_argument("--configs", default="dp,0,1,2,3")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="runs/pynative")
    ap.add_argument("--phases", action="store_true", help="PyNative's step split into its phases (module note)")
    a = ap.parse_args()
    models, configs = a.models.split(","), a.configs.split(",")
    bad = [m for m in models if m not in MODELS] + [c for c in configs if c not in ("dp", "0", "1", "2", "3")]
    if bad or "dp" not in configs:
        ap.error(f"--models from {list(MODELS)}, --configs from dp,0,1,2,3 with dp among them; got {bad or configs}")
    if a.phases:
        return phases(models, configs, a)
    runs = {m: {mode: {c: [] for c in configs} for mode in MODES} for m in models}
    for model in models:
        for repeat in range(a.repeats):
            for config in configs:
                for mode in MODES:
                    runs[model][mode][config].append(run(model, mode, config, a, repeat))
    rows = summarize(runs)
    out = Path(a.out)
    (out / "results.json").write_text(json.dumps(dict(world=a.world, steps=a.steps, repeats=a.repeats, rows=rows),
                                                 indent=1))
    text = markdown(rows, a)
    (out / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Where the first step goes: graph compile, the first execution, and a steady step, for plain DP and stages 0-3.

    .venv/bin/python benchmarks/first_step.py [--worlds 2] [--configs dp,0,1,2,3] [--repeats 2]
        [--dim 512 --layers 6 --vocab 512 --seq 64] [--baseline DIR] [--out runs/first_step]

Each configuration is launched ``--repeats`` times (msrun, one launch per run, so every run compiles from
nothing) by ``zero_bench_worker.py --split-compile``: the step is compiled with ``Cell.compile`` (MindSpore's
front end and the CPU backend's kernel graph), then executed once (the first execution: every collective kernel's
first run, the memory pool's first allocations), then stepped ``--steps`` more times (the median is the steady
step). One more launch (``first_step_worker.py``) times, per kind of collective, the compile and the first and
second execution of a graph holding that one collective, so the first execution's share that is the collectives'
own start-up is visible apart from the network.

Per configuration (rank 0, the median over the repeats; every run in the JSON): ``prepare_train_network``'s
seconds (before the step: the plan, the cross-rank checks, the shards; with ``--lazy`` builds, materialising them;
plain DP: ``nn.TrainOneStepCell``), compile s, first execution s,
the first step (their sum) and its ratio to plain DP's, the steady step, the first step's excess over a steady
step, the collectives per step and the distinct collective kernels (kind and size) of the plan.

``--baseline DIR``: a checkout of another commit (``git worktree add DIR <commit>``): every launch is made from
both trees, interleaved, so a before/after comparison is measured side by side in one run; each tree's ratios are
to its own plain DP, and the table says whether each configuration's losses are the baseline's, bit for bit.

Writes ``results.json`` and ``results.md`` under ``--out``. Needs the machine alone: the ranks of a launch share
its cores, and the figures are seconds.
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
from zero_bench_worker import add_model_args, model_args  # noqa: E402

#: the example GPT of the first-step measurements (examples/gpt.py's shape: width 512, 6 blocks, vocabulary 512,
#: sequence 64); ``--dim 768 --layers 14 --vocab 8192`` is the 105M GPT of zero_bench.py
DEFAULTS = dict(dim=512, layers=6, heads=8, vocab=512, seq=64, batch=2)


def run(config, world, out: Path, a, repeat: int, root: Path = ROOT, tag: str = "") -> dict:
    run_dir = out / f"w{world}_{config}_r{repeat}{tag}"
    args = ["--config", config, "--steps", str(a.steps), "--split-compile", "--persistence", str(a.persistence),
            *model_args(a)]
    if config != "dp":
        args.append("--lazy")
    t = time.time()
    msrun(root / "benchmarks" / "zero_bench_worker.py", world, run_dir, args=args, timeout=a.timeout)
    print(f"  {NAMES[config]}{tag} x{world} run {repeat}: {time.time() - t:.0f}s", flush=True)
    return json.loads((run_dir / "rank_0.json").read_text())


def summarize(runs: dict, world: int) -> list:
    rows, dp = [], None
    for config, ranks in runs.items():
        med = lambda key: statistics.median(r[key] for r in ranks)  # noqa: E731
        steady = statistics.median(statistics.median(r["times"]) for r in ranks)
        prepare = statistics.median(next(p["seconds"] for p in r["phases"] if p["phase"] == "prepare") for r in ranks)
        row = dict(config=config, name=NAMES[config], world=world, repeats=len(ranks), prepare_s=prepare,
                   compile_s=med("compile_s"), first_execution_s=med("first_execution_s"),
                   first_step_s=med("first_step_s"), steady_s=steady,
                   every_first_step=[round(r["first_step_s"], 2) for r in ranks],
                   calls=ranks[0]["comm"]["total"]["calls"],  # the plan's (plain DP: its all-reduces)
                   kernels=ranks[0].get("distinct_kernels"),  # distinct (kind, bytes); plain DP: not counted
                   losses=ranks[0].get("losses"))
        row["excess_s"] = row["first_step_s"] - steady
        if config == "dp":
            dp = row
        rows.append(row)
    for row in rows:
        if dp is not None:
            row["ratio"] = row["first_step_s"] / dp["first_step_s"]
            row["compile_ratio"] = row["compile_s"] / dp["compile_s"]
    return rows


def collectives(world: int, out: Path, a) -> list:
    run_dir = out / f"w{world}_collectives"
    msrun(ROOT / "benchmarks" / "first_step_worker.py", world, run_dir, timeout=a.timeout)  # the launcher gives --out
    return json.loads((run_dir / "rank_0.json").read_text())["kinds"]


def markdown(rows, kinds, command: str) -> str:
    lines = [f"`{command}`", "",
             "| config | ranks | prepare s | compile s | first execution s | first step s | vs DP | compile vs DP "
             "| steady step s | first step - steady s | collectives/step | distinct collective kernels "
             "| every run's first step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['world']} | {r['prepare_s']:.2f} | {r['compile_s']:.2f} | "
                     f"{r['first_execution_s']:.2f} | {r['first_step_s']:.2f} | {r.get('ratio', float('nan')):.2f}x | "
                     f"{r.get('compile_ratio', float('nan')):.2f}x | {r['steady_s']:.2f} | {r['excess_s']:.2f} | "
                     f"{r['calls']} | {r['kernels'] if r['kernels'] is not None else ''} | "
                     f"{r['every_first_step']} |" + ("" if "same_losses_as_baseline" not in r else
                                                       f" losses as the baseline: {r['same_losses_as_baseline']} |"))
    if kinds:
        lines += ["", "One collective alone (a graph holding it; 1 MiB of fp32; rank 0):", "",
                  "| collective | compile s | first execution s | second execution s |", "|---|---|---|---|"]
        for k in kinds:
            lines.append(f"| {k['kind']} | {k['compile_s']:.3f} | {k['first_s']:.4f} | {k['second_s']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--configs", default="dp,0,1,2,3")
    ap.add_argument("--repeats", type=int, default=2, help="launches per configuration (each compiles anew)")
    ap.add_argument("--steps", type=int, default=3, help="steps after the first (the steady step's median)")
    ap.add_argument("--persistence", type=int, default=100_000, help="the threshold of a 'p' configuration")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--baseline", help="a checkout of another commit, launched beside this tree (interleaved)")
    ap.add_argument("--out", default="runs/first_step")
    add_model_args(ap, **DEFAULTS)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "benchmarks/first_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"command": command, "worlds": {}}
    text = []
    trees = [("", ROOT)] + ([("@baseline", Path(a.baseline).resolve())] if a.baseline else [])
    for world in (int(w) for w in a.worlds.split(",")):
        runs = {tag: {} for tag, _ in trees}
        for repeat in range(a.repeats):  # interleaved: a slow minute of the machine touches every configuration
            for tag, root in trees:
                for config in a.configs.split(","):
                    runs[tag].setdefault(config, []).append(run(config, world, out, a, repeat, root, tag))
        kinds = collectives(world, out, a)
        results["worlds"][world] = {}
        summaries = {tag: summarize(runs[tag], world) for tag, _ in trees}
        if a.baseline:  # this tree's rows against the baseline's, configuration by configuration
            base = {r["config"]: r for r in summaries["@baseline"]}
            for row in summaries[""]:
                row["same_losses_as_baseline"] = row["losses"] == base[row["config"]]["losses"]
        for tag, root in trees:
            rows = summaries[tag]
            results["worlds"][world][tag or "this tree"] = dict(rows=rows, root=str(root))
            text.append(f"{'baseline ' + str(root) if tag else 'this tree'}:\n\n"
                        + markdown(rows, kinds if tag == trees[-1][0] else [], command))
        results["worlds"][world]["collectives"] = kinds
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()

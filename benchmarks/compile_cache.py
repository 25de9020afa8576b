"""The first step of a launch that finds its train step compiled: ``compile_cache`` against compiling anew.

    .venv/bin/python benchmarks/compile_cache.py [--worlds 2] [--configs dp,1,2,3] [--repeats 2]
        [--dim 512 --layers 6 --vocab 512 --seq 64] [--out runs/compile_cache]

Per configuration and repeat, two launches in a row share a fresh cache directory: the first compiles and keeps
the step (a first launch), the second loads it (a resumed or restarted job). ZeRO configurations pass
``compile_cache=DIR`` to ``prepare_train_network``; plain DP (``nn.TrainOneStepCell``, which mindzero does not
build) runs with MindSpore's own process-wide cache (``MS_COMPILER_CACHE_ENABLE=1``, ``MS_COMPILER_CACHE_PATH``),
as a plain-DP user would. Each launch is ``zero_bench_worker.py --split-compile`` (compile, first execution,
``--steps`` steady steps), rank 0's figures, medians over the repeats; launches interleaved across configurations.

Prints and writes (``results.json``, ``results.md`` under ``--out``) per configuration: compile s and first step s
of the first launch and of the second, the second's first step against plain DP's first launch and against plain
DP's second (both cached), and whether the two launches trained the same losses bit for bit. Needs the machine
alone.
"""
import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from mindzero.launch.local import msrun  # noqa: E402
from zero_bench import NAMES  # noqa: E402
from zero_bench_worker import add_model_args, model_args  # noqa: E402

DEFAULTS = dict(dim=512, layers=6, heads=8, vocab=512, seq=64, batch=2)  # the example GPT (first_step.py's)


def launch(config, world, run_dir: Path, cache: Path, a) -> dict:
    args = ["--config", config, "--steps", str(a.steps), "--split-compile", *model_args(a)]
    env = {}
    if config == "dp":
        env = {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(cache)}
    else:
        args += ["--compile-cache", str(cache)]
    msrun(ROOT / "benchmarks" / "zero_bench_worker.py", world, run_dir, args=args, timeout=a.timeout, env=env)
    return json.loads((run_dir / "rank_0.json").read_text())


def summarize(runs: dict) -> list:
    rows = []
    for config, pairs in runs.items():
        med = lambda i, key: statistics.median(p[i][key] for p in pairs)  # noqa: E731
        rows.append(dict(config=config, name=NAMES[config], repeats=len(pairs),
                         compile_cold=med(0, "compile_s"), compile_warm=med(1, "compile_s"),
                         first_cold=med(0, "first_step_s"), first_warm=med(1, "first_step_s"),
                         steady_cold=statistics.median(statistics.median(p[0]["times"]) for p in pairs),
                         steady_warm=statistics.median(statistics.median(p[1]["times"]) for p in pairs),
                         every_first=[[round(p[0]["first_step_s"], 2), round(p[1]["first_step_s"], 2)] for p in pairs],
                         same_losses=all(p[0]["losses"] == p[1]["losses"] for p in pairs)))
    dp = next((r for r in rows if r["config"] == "dp"), None)
    for r in rows:
        if dp is not None:
            r["warm_vs_dp_cold"] = r["first_warm"] / dp["first_cold"]
            r["warm_vs_dp_warm"] = r["first_warm"] / dp["first_warm"]
            r["cold_vs_dp_cold"] = r["first_cold"] / dp["first_cold"]
    return rows


def markdown(rows, command: str) -> str:
    lines = [f"`{command}`", "",
             "| config | compile s, first launch | compile s, cached | first step s, first launch | first step s, "
             "cached | first launch vs plain DP's | cached vs plain DP's first launch | cached vs plain DP cached "
             "| steady step s (first / cached) | losses the same | every repeat's first steps s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        lines.append(f"| {r['name']} | {r['compile_cold']:.2f} | {r['compile_warm']:.2f} | {r['first_cold']:.2f} | "
                     f"{r['first_warm']:.2f} | {r.get('cold_vs_dp_cold', nan):.2f}x | "
                     f"{r.get('warm_vs_dp_cold', nan):.2f}x | {r.get('warm_vs_dp_warm', nan):.2f}x | "
                     f"{r['steady_cold']:.2f} / {r['steady_warm']:.2f} | {r['same_losses']} | {r['every_first']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--configs", default="dp,1,2,3")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of launches per configuration")
    ap.add_argument("--steps", type=int, default=3, help="steps after the first (the steady step's median)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="runs/compile_cache")
    add_model_args(ap, **DEFAULTS)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "benchmarks/compile_cache.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results, text = {"command": command, "worlds": {}}, []
    for world in (int(w) for w in a.worlds.split(",")):
        runs = {}
        for repeat in range(a.repeats):
            for config in a.configs.split(","):
                cache = (out / f"cache_w{world}_{config}_r{repeat}").resolve()  # the ranks run in their own cwd
                shutil.rmtree(cache, ignore_errors=True)
                pair = [launch(config, world, out / f"w{world}_{config}_r{repeat}_{which}", cache, a)
                        for which in ("first", "cached")]
                print(f"  {NAMES[config]} x{world} repeat {repeat}: first step {pair[0]['first_step_s']:.2f} s, "
                      f"cached {pair[1]['first_step_s']:.2f} s", flush=True)
                runs.setdefault(config, []).append(pair)
        rows = summarize(runs)
        results["worlds"][world] = rows
        text.append(f"{world} ranks:\n\n" + markdown(rows, command))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()

"""Memory and speed of mindzero stages 0-3 against plain MindSpore data parallel, measured in one run.

    .venv/bin/python benchmarks/zero_bench.py [--worlds 2,4] [--configs dp,0,1,2,3] [--out runs/zero_bench]

For each world size, one msrun launch per configuration (so each process's peak RSS is that
configuration's alone) trains the same GPT (default 14 layers, width 768, vocab 8192, tied head:
105M parameters, fp32, AdamWeightDecay) on random tokens: ``dp`` is ``nn.TrainOneStepCell`` under
MindSpore's DATA_PARALLEL context (its own gradient all-reduce), ``0``-``3`` are
``mindzero.prepare_train_network(zero_stage=...)`` with ``comm_fusion`` buckets of ``--bucket-mib``.

Per configuration and world size it records (rank 0; all ranks are written to the JSON):

* peak RSS (``VmHWM``) and RSS after ``init()`` (the framework), and the ZeRO formula's prediction
  (RSS after init + fp32 formula bytes);
* model-state bytes (``memory_report``; counted from the Parameters for dp) next to the formula;
* median step time over ``--steps`` steps after ``--warmup`` and its ratio to dp of the same world;
* collectives and bytes per step per rank (``zero_info.calls``; dp: one all-reduce per gradient);
* for dp, the time of one all-reduce of Φ floats and one all-gather of Φ/N: the step's compute
  and communication split.

Writes ``results.json``, ``results.md`` (the tables) and ``zero_bench.png`` under ``--out``.
The launcher (``mindzero.local_launch``) runs workers under ``MALLOC_MMAP_THRESHOLD_=1048576`` (freed
buffers go back to the OS, so peak RSS measures what was live).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.estimate import paper_formula  # noqa: E402
from mindzero.local_launch import msrun  # noqa: E402

MIB = 2 ** 20
NAMES = {"dp": "plain DP", "0": "stage 0", "1": "stage 1", "2": "stage 2", "3": "stage 3"}


def run_config(config, world, out, a):
    run_dir = out / f"w{world}_{config}"
    if (run_dir / "rank_0.json").exists() and a.reuse:
        return [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(world)]
    args = ["--config", config, "--steps", str(a.steps), "--warmup", str(a.warmup), "--dim", str(a.dim),
            "--layers", str(a.layers), "--heads", str(a.heads), "--vocab", str(a.vocab), "--seq", str(a.seq),
            "--batch", str(a.batch), "--bucket-mib", str(a.bucket_mib)]
    if a.no_regather:
        args.append("--no-regather")
    t = time.time()
    msrun(ROOT / "benchmarks" / "zero_bench_worker.py", world, run_dir, args=args, timeout=a.timeout)
    print(f"  {NAMES[config]} x{world}: {time.time() - t:.0f}s", flush=True)
    return [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(world)]


def summarize(results, world):
    """Rows of one world size: rank 0's numbers, ratios to dp."""
    rows = []
    dp = results["dp"][0]
    dp_time = statistics.median(dp["times"])
    dp_states = sum(dp["memory"].values())
    dp_full = sum(paper_formula(dp["phi"], 0, world, mixed_precision=False).values())
    for config, ranks in results.items():
        r0 = ranks[0]
        t = statistics.median(r0["times"])
        states = sum(r0["memory"].values())
        stage = 0 if config == "dp" else int(config)
        formula = sum(paper_formula(r0["phi"], stage, world, mixed_precision=False).values())
        if r0["memory"]["gradients"] == 0:  # without accumulation gradients live only inside the step
            formula -= paper_formula(r0["phi"], stage, world, mixed_precision=False)["gradients"]
        comm = r0["comm"]["total"]
        rows.append(dict(
            config=config, world=world, phi=r0["phi"],
            step_s=t, step_ratio=t / dp_time, step_s_all_ranks=[statistics.median(x["times"]) for x in ranks],
            peak_rss_mib=max(x["vmhwm_kib"] for x in ranks) / 1024, rss_init_mib=r0["rss_init_kib"] / 1024,
            rss_predicted_mib=r0["rss_init_kib"] / 1024 + formula / MIB,
            states_mib=states / MIB, states_formula_mib=formula / MIB, states_vs_dp=states / dp_states,
            states_vs_dp_formula=formula / dp_full if config != "dp" else None,
            memory=r0["memory"], memory_expected=r0.get("memory_expected"),
            calls=comm["calls"], comm_mib=comm["bytes"] / MIB, traffic_mib=comm["traffic"] / MIB,
            traffic_real_mib=r0["comm_real"]["total"]["traffic"] / MIB,
            comm_by_op={op: r0["comm"][op] for op in ("all_reduce", "reduce_scatter", "all_gather")},
            losses=r0["losses"], collective_seconds=r0.get("collective_seconds")))
    return rows


def markdown(rows):
    lines = ["| world | config | step s (median) | ratio to DP | peak RSS MiB | predicted RSS MiB | model states MiB "
             "(measured) | formula MiB | states vs DP | collectives/step | MiB moved/step (ring traffic; real RS) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {NAMES[r['config']]} | {r['step_s']:.2f} | {r['step_ratio']:.2f}x | "
                     f"{r['peak_rss_mib']:.0f} | {r['rss_predicted_mib']:.0f} | {r['states_mib']:.0f} | "
                     f"{r['states_formula_mib']:.0f} | {r['states_vs_dp']:.0%} | {r['calls']} | "
                     f"{r['traffic_mib']:.0f} ({r['traffic_real_mib']:.0f}) |")
    return "\n".join(lines)


def chart(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(worlds)
    configs = list(NAMES)
    for k, w in enumerate(worlds):
        sel = {r["config"]: r for r in rows if r["world"] == w}
        xs = [i + k * width for i in range(len(configs))]
        axes[0].bar(xs, [sel[c]["peak_rss_mib"] if c in sel else 0 for c in configs], width, label=f"{w} ranks")
        axes[1].bar(xs, [sel[c]["states_mib"] if c in sel else 0 for c in configs], width, label=f"{w} ranks")
        axes[2].bar(xs, [sel[c]["step_ratio"] if c in sel else 0 for c in configs], width, label=f"{w} ranks")
    titles = ["peak RSS per rank (MiB)", "model-state bytes per rank (MiB)", "step time / plain DP"]
    for ax, title in zip(axes, titles):
        ax.set_xticks([i + width * (len(worlds) - 1) / 2 for i in range(len(configs))])
        ax.set_xticklabels([NAMES[c] for c in configs])
        ax.set_title(title)
        ax.legend()
    axes[2].axhline(1.0, color="gray", lw=0.8)
    phi = rows[0]["phi"] / 1e6
    fig.suptitle(f"mindzero vs plain data parallel: GPT {phi:.0f}M params, fp32 AdamWeightDecay, CPU (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--configs", default="dp,0,1,2,3")
    ap.add_argument("--out", default="runs/zero_bench")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, default=64.0)
    ap.add_argument("--no-regather", action="store_true", help="stage 3 keeps gathered parameters (faster, more memory)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--reuse", action="store_true", help="reuse finished configurations under --out")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs = a.configs.split(",")
    if "dp" not in configs:
        configs.insert(0, "dp")
    rows = []
    start = time.time()
    for world in (int(w) for w in a.worlds.split(",")):
        results = {c: run_config(c, world, out, a) for c in configs}
        rows += summarize(results, world)
    table = markdown(rows)
    print(table)
    command = "python benchmarks/zero_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = dict(command=command.strip(), seconds=time.time() - start, cpu_count=os.cpu_count(),
                model=dict(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads, seq=a.seq, batch=a.batch),
                steps=a.steps, warmup=a.warmup, bucket_mib=a.bucket_mib, regather=not a.no_regather)
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "results.md").write_text(f"`{meta['command']}`\n\n{table}\n")
    chart(rows, out / "zero_bench.png")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'zero_bench.png'} in {meta['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

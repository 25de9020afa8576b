"""Memory and speed of mindzero stages 0-3 against plain MindSpore data parallel, measured in one run.

    .venv/bin/python benchmarks/zero_bench.py [--worlds 2,4] [--configs dp,0,1,2,3] [--fp16] [--out runs/zero_bench]
        [--link-rate 200mbit [--link-delay 1ms]]

For each world size, one msrun launch per configuration (so each process's memory is that
configuration's alone) trains the same GPT (default 14 layers, width 768, vocab 8192, tied head: 105M
parameters, fp32, AdamWeightDecay) on random tokens: ``dp`` is ``nn.TrainOneStepCell`` under MindSpore's
DATA_PARALLEL context (its own gradient all-reduce), built as users build it; ``0``-``3`` are
``mindzero.prepare_train_network(zero_stage=...)`` on the same network built under
``mindzero.lazy_init()`` (``--eager`` builds it eagerly instead). ``--fp16``: every configuration computes
in fp16 (AMP O2, the loss in fp32); ``0``-``3`` also hold fp16 parameters with fp32 masters
(``param_dtype=float16``) and are compared with the paper's mixed-precision formula.

Per configuration and world size (rank 0's numbers; every rank's are in the JSON):

* peak RSS above the RSS right after ``init()`` (the framework), the ZeRO fp32 formula beside it
  (4 bytes/param parameters and gradients, 8 Adam; stage 1-2 master shard 4/N), and the ratio to DP;
* the memory timeline: RSS at the end of and peak during each phase (init, build, prepare, first step,
  steady steps);
* time to first step (compile and one step) and the median steady step, as ratios to DP's;
* collectives and bytes per step per rank (the plan, ``zero_info.calls``).

Writes ``results.json``, ``results.md`` (tables and the goals) and ``zero_bench.png``,
``zero_bench_timeline.png`` under ``--out``. Workers run under ``MALLOC_MMAP_THRESHOLD_=1048576`` (set
by ``mindzero.launch.local``): freed large buffers go back to the OS, so RSS measures what is live.
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
from mindzero.core.estimate import paper_formula  # noqa: E402
from mindzero.core.offload import DEFAULT_CHUNK_MB  # noqa: E402
from mindzero.launch.link import LinkShape  # noqa: E402
from mindzero.launch.local import msrun  # noqa: E402
from zero_bench_worker import add_model_args, model_args  # noqa: E402

MIB = 2 ** 20
NAMES = {"dp": "plain DP", "0": "stage 0", "1": "stage 1", "2": "stage 2", "3": "stage 3",
         "2bfs": "stage 2, default order", "3bfs": "stage 3, default order",  # bfs: before the depth-first compile
         "3q": "stage 3, int8 gathers", "3h": "stage 3, fp16 reduction", "3qh": "stage 3, int8 + fp16",
         "3u": "stage 3, a gather per block", "3uh": "stage 3, per block + fp16", "3quh": "stage 3, all three",
         "3p": "stage 3, small kept whole", "3qhp": "stage 3, int8 + fp16 + small kept whole",
         "3quhp": "stage 3, all three + small kept whole",
         "1d": "stage 1, states on disk", "2d": "stage 2, states on disk", "3d": "stage 3, states on disk",
         "3pd": "stage 3, small kept whole, states on disk",
         "1o": "stage 1, owned whole", "2o": "stage 2, owned whole", "3o": "stage 3, owned whole"}
PHASES = ("init", "build", "prepare", "first_step", "steady")


def run_config(config, world, out, a):
    run_dir = out / f"w{world}_{config}"
    if a.reuse and all((run_dir / f"rank_{r}.json").exists() for r in range(world)):
        return [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(world)]
    args = ["--config", config, "--steps", str(a.steps), "--bucket-mib", str(a.bucket_mib),
            "--optimizer", getattr(a, "optimizer", "adamw"),
            "--persistence", str(a.persistence), "--chunk-mb", str(getattr(a, "chunk_mb", DEFAULT_CHUNK_MB)), *model_args(a)]
    if config != "dp" and not a.eager:
        args.append("--lazy")
    if config == "dp" and a.time_collectives:
        args.append("--time-collectives")
    if a.fp16:
        args.append("--fp16")
    t = time.time()
    msrun(ROOT / "benchmarks" / "zero_bench_worker.py", world, run_dir, args=args, timeout=a.timeout, link=a.link)
    print(f"  {NAMES[config]} x{world}: {time.time() - t:.0f}s", flush=True)
    ranks = [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(world)]
    if a.link is not None:  # what the shaped loopback carried during the whole job (every rank, compile included)
        ranks[0]["link"] = json.loads((run_dir / "link.json").read_text())
        (run_dir / "rank_0.json").write_text(json.dumps(ranks[0]))
    return ranks


def peak_above_init(rank_result) -> float:
    """MiB: the highest RSS of any phase after init, minus the RSS right after init."""
    rows = rank_result["phases"]
    return (max(p["peak_kib"] for p in rows[1:]) - rows[0]["rss_kib"]) / 1024


def formula_mib(phi, stage, world, mixed=False) -> float:
    """The ZeRO formula for what a rank holds during a step: parameters, gradients, Adam states (fp32, or
    the paper's mixed-precision one for a ``--fp16`` ZeRO configuration)."""
    return sum(paper_formula(phi, stage, world, mixed_precision=mixed).values()) / MIB


def summarize(results, world):
    """Rows of one world size: rank 0's numbers, ratios to dp."""
    rows = []
    dp = results["dp"][0]
    dp_peak, dp_first, dp_step = peak_above_init(dp), dp["first_step_s"], statistics.median(dp["times"])
    for config, ranks in results.items():
        r0 = ranks[0]
        stage = 0 if config == "dp" else int(config[0])
        peak = max(peak_above_init(x) for x in ranks)
        step = statistics.median(r0["times"])
        comm = r0["comm"]["total"]
        rows.append(dict(
            config=config, world=world, phi=r0["phi"], lazy=r0["lazy"],
            peak_above_init_mib=peak, peak_ratio=peak / dp_peak, rss_init_mib=r0["phases"][0]["rss_kib"] / 1024,
            formula_mib=formula_mib(r0["phi"], stage, world, r0.get("fp16", False) and config != "dp"),
            fp16=r0.get("fp16", False), overflows=r0.get("overflows", 0),
            states_mib=sum(r0["memory"].values()) / MIB, memory=r0["memory"], memory_expected=r0.get("memory_expected"),
            first_step_s=r0["first_step_s"], first_step_ratio=r0["first_step_s"] / dp_first,
            step_s=step, step_ratio=step / dp_step, step_s_all_ranks=[statistics.median(x["times"]) for x in ranks],
            timeline=[dict(phase=p["phase"], rss_mib=(p["rss_kib"] - r0["phases"][0]["rss_kib"]) / 1024,
                           peak_mib=(p["peak_kib"] - r0["phases"][0]["rss_kib"]) / 1024, seconds=p["seconds"])
                      for p in r0["phases"]],
            calls=comm["calls"], comm_mib=comm["bytes"] / MIB, traffic_mib=comm["traffic"] / MIB,
            traffic_real_mib=r0["comm_real"]["total"]["traffic"] / MIB,
            losses=r0["losses"], collective_seconds=r0.get("collective_seconds"),
            link_mib=r0["link"]["bytes"] / MIB if "link" in r0 else None,
            updates=r0.get("updates"), balance=r0.get("balance")))
    return rows


def goals(rows) -> list:
    """The benchmark's goals (peaks against plain DP's and each other, time to first step), checked against the
    rows: ``(goal, measured, met)``."""
    out = []
    for w in sorted({r["world"] for r in rows}):
        sel = {r["config"]: r for r in rows if r["world"] == w}
        dp = sel.get("dp")
        if "0" in sel:
            out.append((f"{w} ranks: stage 0 peak within 5% of plain DP's",
                        f"{sel['0']['peak_ratio']:.3f}x", sel["0"]["peak_ratio"] <= 1.05))
        for s in ("1", "2"):
            if s in sel:
                states = [paper_formula(dp["phi"], stage, w, mixed_precision=False)["optimizer_states"]
                          for stage in (0, int(s))]
                saved = (states[0] - states[1]) / MIB  # the optimizer-state bytes the stage saves
                below = dp["peak_above_init_mib"] - sel[s]["peak_above_init_mib"]
                out.append((f"{w} ranks: stage {s} below plain DP by at least the {saved:.0f} MiB of optimizer "
                            "states it saves", f"{below:.0f} MiB below", below >= saved))
        if "2" in sel and "2bfs" in sel:  # depth-first order frees each full gradient at its reduction
            half_grads = 4 * dp["phi"] / 2 / MIB
            below = sel["2bfs"]["peak_above_init_mib"] - sel["2"]["peak_above_init_mib"]
            out.append((f"{w} ranks: stage 2 peak below the same step's in MindSpore's default order by at least "
                        f"half the full gradient bytes ({half_grads:.0f} MiB)", f"{below:.0f} MiB below",
                        below >= half_grads))
        if "1" in sel and "2" in sel:  # without accumulation stage 1 compiles stage 2's step in the same order
            ratio = sel["1"]["peak_above_init_mib"] / sel["2"]["peak_above_init_mib"]
            out.append((f"{w} ranks: stage 1 peak within 3% of stage 2's (the same step without accumulation)",
                        f"{ratio:.3f}x", abs(ratio - 1) <= 0.03))
        if "3" in sel and w == 4:
            out.append(("4 ranks: stage 3 peak at most 0.40x plain DP's", f"{sel['3']['peak_ratio']:.2f}x",
                        sel["3"]["peak_ratio"] <= 0.40))
        for c in ("0", "1", "2", "3", "3qh"):
            if c in sel:
                out.append((f"{w} ranks: {NAMES[c]} time to first step at most 1.3x plain DP's",
                            f"{sel[c]['first_step_ratio']:.2f}x", sel[c]["first_step_ratio"] <= 1.3))
        if "3qh" in sel:
            out.append((f"{w} ranks: stage 3 with int8 gathers and fp16 reduction at most 1.0x plain DP's steady "
                        "step", f"{sel['3qh']['step_ratio']:.2f}x", sel["3qh"]["step_ratio"] <= 1.0))
        for s in ("1", "2", "3"):  # owner mode against flat sharding of the same optimizer
            if s in sel and s + "o" in sel:
                ratio = sel[s + "o"]["step_s"] / sel[s]["step_s"]
                out.append((f"{w} ranks: {NAMES[s + 'o']} steady step at most 1.3x flat sharding's",
                            f"{ratio:.2f}x", ratio <= 1.3))
                spread = sel[s + "o"]["balance"]["ratio"]
                out.append((f"{w} ranks: {NAMES[s + 'o']} optimizer states of the most loaded rank at most 1.15x the "
                            "even share", f"{spread:.3f}x", spread <= 1.15))
        if "3" in sel:
            base = 517 if w == 4 else sel["3"]["calls"]
            out.append((f"{w} ranks: stage 3 collectives per step at most a quarter of {base}",
                        f"{sel['3']['calls']}", sel["3"]["calls"] <= base / 4))
    return out


def offload_rows(results, world, out: Path) -> list:
    """Per disk-offload configuration (``...d``): its states' bytes per rank, the bytes an update reads and writes,
    the update's measured time (median of the steady steps, rank 0), the time the same bytes take at the disk
    bandwidth measured now on this machine (``benchmarks/disk_bandwidth.py``: every rank's stream at once), and
    the peak and step against the same configuration in memory (the config without its ``d``)."""
    from disk_bandwidth import measure

    rows = []
    for config, ranks in results.items():
        r0 = ranks[0]
        if "offload" not in r0:
            continue
        o, base = r0["offload"], results.get(config[:-1])
        io = o["read_bytes"] + o["written_bytes"]
        bw = measure(out / "bandwidth", o["disk_bytes"] / MIB, world)
        update_s = statistics.median(o["update_s"][1:] or o["update_s"])
        row = dict(world=world, config=config, disk_mib=o["disk_bytes"] / MIB, io_mib=io / MIB,
                   buffers_mib=o["buffer_bytes"] / MIB, pieces=o["pieces"], views=o["views"], update_s=update_s,
                   io_s=bw["update_io_s"], update_vs_io=update_s / bw["update_io_s"], bandwidth=bw,
                   peak_mib=peak_above_init(r0), step_s=statistics.median(r0["times"]))
        if base:
            row.update(base_peak_mib=peak_above_init(base[0]), base_step_s=statistics.median(base[0]["times"]))
            row["saved_vs_states"] = (row["base_peak_mib"] - row["peak_mib"]) / row["disk_mib"]
            row["added_s"] = row["step_s"] - row["base_step_s"]
        rows.append(row)
    return rows


def offload_markdown(rows) -> str:
    if not rows:
        return ""
    lines = ["", "", "Optimizer states on disk (rank 0; bandwidth measured now, every rank's stream at once):", "",
             "| world | config | states on disk MiB | read + written per update MiB | slots MiB | pieces | update s | "
             "same bytes at the measured bandwidth s | ratio | peak saved / state bytes | step s (in memory) | "
             "added s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = r["bandwidth"]
        lines.append(f"| {r['world']} | {NAMES[r['config']]} | {r['disk_mib']:.0f} | {r['io_mib']:.0f} | "
                     f"{r['buffers_mib']:.0f} | {r['pieces']} | {r['update_s']:.2f} | {r['io_s']:.2f} "
                     f"(write {bw['write_mib_s']:.0f}, read {bw['read_mib_s']:.0f} MiB/s"
                     f"{', dd %.0f / %.0f' % (bw['dd_write_mib_s'], bw['dd_read_mib_s']) if 'dd_read_mib_s' in bw else ''}) | "
                     f"{r['update_vs_io']:.2f}x | {r.get('saved_vs_states', float('nan')):.2f} | "
                     f"{r['step_s']:.2f} ({r.get('base_step_s', float('nan')):.2f}) | {r.get('added_s', float('nan')):.2f} |")
    return "\n".join(lines)


def markdown(rows, command) -> str:
    lines = [f"`{command}`", "",
             "| world | config | peak RSS above init MiB | ratio to DP | formula MiB | model states MiB | "
             "time to first step s | ratio | steady step s | ratio | collectives/step | MiB traffic/step (real RS) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {NAMES[r['config']]} | {r['peak_above_init_mib']:.0f} | {r['peak_ratio']:.2f}x | "
                     f"{r['formula_mib']:.0f} | {r['states_mib']:.0f} | {r['first_step_s']:.1f} | "
                     f"{r['first_step_ratio']:.2f}x | {r['step_s']:.2f} | {r['step_ratio']:.2f}x | {r['calls']} | "
                     f"{r['traffic_mib']:.0f} ({r['traffic_real_mib']:.0f}) |")
    lines += ["", "Memory timeline (MiB above the RSS right after `init()`: at the end of each phase / peak during it):",
              "", "| world | config | " + " | ".join(PHASES[1:]) + " |", "|---|---|" + "---|" * (len(PHASES) - 1)]
    for r in rows:
        cells = [f"{p['rss_mib']:.0f} / {p['peak_mib']:.0f}" for p in r["timeline"][1:]]
        lines.append(f"| {r['world']} | {NAMES[r['config']]} | " + " | ".join(cells) + " |")
    spread = [r for r in rows if r.get("balance")]
    if spread:
        lines += ["", "How the optimizer's update is shared out (the plan's optimizer-state bytes per op rank, MiB):",
                  "", "| world | config | flat / owner / whole parameters | per rank | most loaded / even share |",
                  "|---|---|---|---|---|"]
        for r in spread:
            u, b = r["updates"], r["balance"]
            lines.append(f"| {r['world']} | {NAMES[r['config']]} | {u['flat']} / {u['owner']} / {u['whole']} | "
                         f"{', '.join(f'{x / MIB:.1f}' for x in b['per_rank'])} | {b['ratio']:.3f}x |")
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'yes' if ok else '**no**'} |" for g, m, ok in goals(rows)]
    return "\n".join(lines)


def charts(rows, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    configs = [c for c in NAMES if any(r["config"] == c for r in rows)]
    phi = rows[0]["phi"] / 1e6
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(worlds)
    for k, w in enumerate(worlds):
        sel = {r["config"]: r for r in rows if r["world"] == w}
        xs = [i + k * width for i in range(len(configs))]
        axes[0].bar(xs, [sel[c]["peak_above_init_mib"] for c in configs], width, label=f"{w} ranks")
        axes[0].scatter(xs, [sel[c]["formula_mib"] for c in configs], color="black", marker="_", s=200, zorder=3,
                        label="ZeRO formula" if k == 0 else None)
        axes[1].bar(xs, [sel[c]["first_step_ratio"] for c in configs], width, label=f"{w} ranks")
        axes[2].bar(xs, [sel[c]["step_ratio"] for c in configs], width, label=f"{w} ranks")
    titles = ["peak RSS above init per rank (MiB)", "time to first step / plain DP", "steady step time / plain DP"]
    for ax, title in zip(axes, titles):
        ax.set_xticks([i + width * (len(worlds) - 1) / 2 for i in range(len(configs))])
        ax.set_xticklabels([NAMES[c] for c in configs])
        ax.set_title(title)
        ax.legend()
    for ax in axes[1:]:
        ax.axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"mindzero vs plain data parallel: GPT {phi:.0f}M params, fp32 AdamWeightDecay, CPU (2 cores)")
    fig.tight_layout()
    fig.savefig(out / "zero_bench.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4.5), squeeze=False)
    labels = ["init", "build", "prepare", "first step\n(compile)", "steady steps"]
    for ax, w in zip(axes[0], worlds):
        for r in (r for r in rows if r["world"] == w):
            line, = ax.plot(range(len(r["timeline"])), [p["peak_mib"] for p in r["timeline"]], "o-",
                            label=f"{NAMES[r['config']]} (peak)")
            ax.plot(range(len(r["timeline"])), [p["rss_mib"] for p in r["timeline"]], "x--", color=line.get_color(),
                    alpha=0.6)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_title(f"{w} ranks: RSS above init per phase (o peak during, x at the end)")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "zero_bench_timeline.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "adafactor", "came", "muon"),
                    help="the GPT's optimizer (zero_bench_worker.py); 'o' configurations own every sharded parameter "
                    "whole whatever it is")
    ap.add_argument("--configs", default="dp,0,1,2,3")
    ap.add_argument("--out", default="runs/zero_bench")
    ap.add_argument("--steps", type=int, default=6, help="steady steps after the first")
    add_model_args(ap)
    ap.add_argument("--bucket-mib", type=float, default=0.0, help="comm_fusion buckets (MiB); 0: off (CPU default)")
    ap.add_argument("--fp16", action="store_true", help="mixed precision: fp16 compute (AMP O2) everywhere; the ZeRO "
                    "configurations hold fp16 parameters with fp32 masters (param_dtype=float16)")
    ap.add_argument("--time-collectives", action="store_true",
                    help="plain DP also times one all-reduce of Φ floats and one all-gather (PyNative ops)")
    ap.add_argument("--eager", action="store_true", help="build mindzero's networks eagerly, not under lazy_init")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--reuse", action="store_true", help="reuse finished configurations under --out")
    ap.add_argument("--persistence", type=int, default=100_000,
                    help="stage3_param_persistence_threshold of the 'p' configurations (e.g. 3p)")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB, help="offload_chunk_mb of the 'd' configurations (e.g. 2d)")
    ap.add_argument("--link-rate", help="run every launch behind a shaped loopback of this rate, shared by the ranks "
                                        "(e.g. 200mbit; mindzero.launch.link, docs/launch.md)")
    ap.add_argument("--link-delay", help="with --link-rate: delay added to every packet (e.g. 1ms; needs sch_netem)")
    a = ap.parse_args(argv)
    if a.link_delay and not a.link_rate:
        ap.error(f"--link-delay {a.link_delay}: needs --link-rate")
    a.link = LinkShape.parse(a.link_rate, a.link_delay) if a.link_rate else None
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs = a.configs.split(",")
    if "dp" not in configs:
        configs.insert(0, "dp")
    rows, offload = [], []
    start = time.time()
    for world in (int(w) for w in a.worlds.split(",")):
        results = {c: run_config(c, world, out, a) for c in configs}
        rows += summarize(results, world)
        offload += offload_rows(results, world, out)
    command = "python benchmarks/zero_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(rows, command.strip()) + offload_markdown(offload)
    print(table)
    meta = dict(command=command.strip(), seconds=time.time() - start, cpu_count=os.cpu_count(),
                model=dict(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads, seq=a.seq, batch=a.batch),
                steps=a.steps, bucket_mib=a.bucket_mib, lazy=not a.eager,
                link=None if a.link is None else dict(rate_bit_s=a.link.rate, delay_ms=a.link.delay_ms))
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, goals=goals(rows), offload=offload),
                                                 indent=1))
    (out / "results.md").write_text(table + "\n")
    charts(rows, out)
    print(f"wrote {out}/results.json, results.md, zero_bench.png, zero_bench_timeline.png in {meta['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

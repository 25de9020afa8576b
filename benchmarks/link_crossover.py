"""Step time of plain DP, the stages and stage 3's wire options against the link rate: where each starts to pay.

    .venv/bin/python benchmarks/link_crossover.py --rates none,1gbit,200mbit,50mbit --worlds 4 \\
        --configs dp,1,2,3,3p,3qh,3qhp [--dim 384 --layers 6 ...] [--steps 3] [--out runs/link_crossover]

For each rate (``none``: this machine's loopback, unshaped) one ``zero_bench.py`` run (one launch per
configuration, each behind its own shaped loopback, :mod:`mindzero.launch.link`), then one table and chart over
all rates: the median steady step per configuration, its ratio to plain DP at that rate, the bytes per rank per
step the plan moves (``traffic``), the collectives per step, and the bytes the loopback really carried over the
whole launch (``link_mib``: start-up and compile included). ``--reuse`` keeps finished launches. Writes
``crossover.json``, ``crossover.md`` and ``link_crossover.png`` under ``--out``.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
import zero_bench  # noqa: E402
from mindzero.launch.link import parse_rate  # noqa: E402
from zero_bench_worker import add_model_args, model_args  # noqa: E402


def rate_bits(rate: str):
    return None if rate == "none" else parse_rate(rate)


def table(results, rates, configs) -> str:
    lines = ["| config | collectives/step | MiB/step per rank (plan) | " +
             " | ".join(f"step s at {r} (x DP)" for r in rates) + " |",
             "|---|---|---|" + "---|" * len(rates)]
    for c in configs:
        first = results[rates[0]][c]
        cells = []
        for r in rates:
            row, dp = results[r][c], results[r]["dp"]
            cells.append(f"{row['step_s']:.2f} ({row['step_s'] / dp['step_s']:.2f}x)")
        lines.append(f"| {zero_bench.NAMES[c]} | {first['calls']} | {first['traffic_mib']:.1f} | " + " | ".join(cells)
                     + " |")
    lines += ["", "Bytes the shaped loopback carried per launch (MiB, every rank, start-up and compile included):", "",
              "| config | " + " | ".join(r for r in rates if r != "none") + " |",
              "|---|" + "---|" * sum(r != "none" for r in rates)]
    for c in configs:
        lines.append(f"| {zero_bench.NAMES[c]} | " + " | ".join(f"{results[r][c]['link_mib']:.0f}"
                                                                 for r in rates if r != "none") + " |")
    return "\n".join(lines)


def chart(results, rates, configs, out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = [r for r in rates if r != "none"]
    xs = {r: (rate_bits(r) / 1e6 if r != "none" else None) for r in rates}
    unshaped_x = max(xs[r] for r in shaped) * 4 if shaped else 1.0  # drawn to the right of the fastest shaped rate
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for c in configs:
        pts = sorted(((xs[r] or unshaped_x), results[r][c]["step_s"], results[r][c]["step_s"] / results[r]["dp"]["step_s"])
                     for r in rates)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=zero_bench.NAMES[c])
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=zero_bench.NAMES[c])
    for ax, name in zip(axes, ("steady step (s)", "steady step / plain DP's at that rate")):
        ax.set_xscale("log")
        ax.set_xlabel("shared loopback rate (Mbit/s); rightmost: unshaped")
        ax.set_title(name)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "link_crossover.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="none,1gbit,200mbit,50mbit")
    ap.add_argument("--worlds", default="4")
    ap.add_argument("--configs", default="dp,1,2,3,3p,3qh,3qhp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/link_crossover")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--persistence", type=int, default=100_000, help="the threshold of the 'p' configurations")
    add_model_args(ap)
    a = ap.parse_args(argv)
    rates = a.rates.split(",")
    for r in rates:
        if r != "none":
            parse_rate(r)  # refuse a bad rate before anything runs
    configs = a.configs.split(",")
    if "dp" not in configs:
        configs.insert(0, "dp")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = model_args(a)
    results, meta = {}, None
    for r in rates:
        args = ["--worlds", a.worlds, "--configs", ",".join(configs), "--steps", str(a.steps),
                "--out", str(out / f"rate_{r}"), "--timeout", str(a.timeout), "--persistence", str(a.persistence),
                *model]
        args += ["--reuse"] if a.reuse else []
        args += ["--link-rate", r] if r != "none" else []
        print(f"rate {r}:", flush=True)
        zero_bench.main(args)
        got = json.loads((out / f"rate_{r}" / "results.json").read_text())
        meta = got["meta"]
        results[r] = {row["config"]: row for row in got["rows"]}
    command = "python benchmarks/link_crossover.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"`{command.strip()}`\n\nmodel {meta['model']}, {a.worlds} ranks\n\n" + table(results, rates, configs)
    print(text)
    (out / "crossover.md").write_text(text + "\n")
    (out / "crossover.json").write_text(json.dumps(dict(command=command.strip(), rates=rates, configs=configs,
                                                        model=meta["model"], results=results), indent=1))
    phi = next(iter(results[rates[0]].values()))["phi"] / 1e6
    chart(results, rates, configs, out, f"GPT {phi:.0f}M, {a.worlds} ranks, fp32: step time against the link rate")
    print(f"wrote {out}/crossover.md, crossover.json, link_crossover.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

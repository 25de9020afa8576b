"""Which shaped-link rate gives this machine the compute-to-link ratio of a named accelerator cluster.

    .venv/bin/python benchmarks/link_calibration.py [--results docs/img/zero_bench_results.json] [--world 4]
        [--cluster dgx-a100 ...] [--mfu 0.4] [--out runs/link_calibration]

Reads a measured plain-DP step of the benchmark GPT from a ``zero_bench.py`` results file (the model's shape and
the median steady step at ``--world`` ranks, unshaped: on this machine's loopback the step is compute; its
collectives took a few percent of it, docs/performance.md), counts the step's FLOPs per rank, and shows for each
cluster the arithmetic of :func:`mindzero.launch.link.calibrate`: FLOP/s one rank achieves here against one
device (peak x MFU), the cluster's link per device scaled by that ratio, times the ranks sharing the one
loopback. Then what a step of each configuration in the results file would spend on the wire at that rate
(the plan's bytes per rank; the CPU all-reduce moves twice the ring's bytes, measured in docs/launch.md).

FLOPs per rank of one training step (forward and backward, the usual accounting, Kaplan et al. 2020): 6 x the
matmul parameters x the tokens, plus the attention scores and their use, 12 x layers x seq x width x tokens;
embeddings' lookups are free, the tied head is a matmul of vocab x width. Writes ``calibration.json`` and
``calibration.md`` under ``--out``.
"""
import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.launch.link import CLUSTERS, calibrate  # noqa: E402

# bytes the CPU backend's all-reduce puts on the loopback per byte of a ring all-reduce's share (measured:
# docs/launch.md, "A shaped link"; tests/multirank/test_launch.py checks the ring's bytes as a lower bound)
CPU_WIRE_FACTOR = 2.0


def gpt_step_flops(model: dict) -> float:
    """FLOPs of one rank's training step of the benchmark GPT (``examples/gpt.py``: blocks of qkv, proj, fc1,
    fc2 with 4x expansion, a tied head)."""
    d, layers, tokens = model["dim"], model["layers"], model["batch"] * model["seq"]
    matmul = layers * 12 * d * d + model["vocab"] * d
    return 6 * matmul * tokens + 12 * layers * model["seq"] * d * tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(ROOT / "docs" / "img" / "zero_bench_results.json"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cluster", action="append", choices=sorted(CLUSTERS), help="default: all")
    ap.add_argument("--mfu", type=float, default=None, help="the fraction of peak a device achieves (default 0.4)")
    ap.add_argument("--out", default="runs/link_calibration")
    a = ap.parse_args(argv)
    res = json.loads(Path(a.results).read_text())
    rows = [r for r in res["rows"] if r["world"] == a.world]
    dp = next((r for r in rows if r["config"] == "dp"), None)
    if dp is None:
        ap.error(f"--results {a.results}: no plain-DP row at world {a.world} (zero_bench.py --worlds {a.world})")
    if dp.get("link") or res["meta"].get("link"):
        ap.error(f"--results {a.results}: measured behind a shaped link; calibrate from an unshaped run")
    flops = gpt_step_flops(res["meta"]["model"])
    lines = [f"# Link calibration ({a.results}, plain DP at {a.world} ranks: {dp['step_s']:.2f} s per step, "
             f"model {res['meta']['model']})", ""]
    record = dict(results=a.results, world=a.world, step_flops=flops, step_s=dp["step_s"], clusters=[])
    for name in a.cluster or sorted(CLUSTERS):
        cluster = CLUSTERS[name] if a.mfu is None else replace(CLUSTERS[name], mfu=a.mfu)
        cal = calibrate(flops, dp["step_s"], a.world, cluster)
        lines += ["```", cal.explain(), "```", "",
                  f"At {cal.rate / 1e6:.3g} Mbit/s, seconds on the wire per step (the plan's bytes per rank x "
                  f"{a.world} ranks x {CPU_WIRE_FACTOR:g} for the CPU all-reduce, over the rate) against the "
                  "unshaped step:", "", "| config | MiB per rank (plan) | wire s | unshaped step s |", "|---|---|---|---|"]
        wire = {}
        for r in rows:
            seconds = r["traffic_mib"] * 2 ** 20 * a.world * CPU_WIRE_FACTOR / (cal.rate / 8)
            wire[r["config"]] = seconds
            lines.append(f"| {r['config']} | {r['traffic_mib']:.0f} | {seconds:,.0f} | {r['step_s']:.1f} |")
        lines.append("")
        record["clusters"].append(dict(name=name, cluster=cluster.name, mfu=cluster.mfu, rate_bit_s=cal.rate,
                                       slowdown=cal.slowdown, here_flops=cal.here_flops, wire_s=wire,
                                       explain=cal.explain()))
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(record, indent=1))
    (out / "calibration.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which shaped-link rate gives this machine the compute-to-link ratio of a named accelerator cluster.

    .venv/bin/python benchmarks/link_calibration.py [--results docs/results/zero_bench_results.json] [--world 4]
        [--cluster dgx-a100 ...] [--mfu 0.4] [--out runs/link_calibration]

Reads a measured plain-DP step of the benchmark GPT from a ``zero_bench.py`` results file (the model's shape and
the median steady step at ``--world`` ranks, unshaped: on this machine's loopback the step is compute; its
collectives took a few percent of it, docs/performance.md), counts the step's FLOPs per rank, and shows for each
cluster the arithmetic of :func:`calibrate` (below): FLOP/s one rank achieves here against one
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
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# --- which shared-link rate gives this machine a cluster's compute-to-link ratio --------------------------------
@dataclass(frozen=True)
class Cluster:
    """An accelerator cluster as the calibration sees it: one device's dense peak (FLOP/s, the datasheet's),
    the fraction of it training reaches (model FLOPs utilisation), and the network bandwidth per device (bit/s:
    a node's NICs divided by its devices)."""

    name: str
    peak_flops: float
    link_bits: float
    mfu: float = 0.4
    source: str = ""

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.mfu


CLUSTERS = {
    "dgx-a100": Cluster("DGX A100 nodes, 8 x A100 SXM, 8 x 200 Gb/s HDR InfiniBand", 312e12, 200e9,
                        source="NVIDIA A100 datasheet (312 TFLOPS BF16 dense); DGX A100 user guide (8 x HDR "
                               "200 Gb/s compute NICs, one per GPU)"),
    "p3dn-v100": Cluster("AWS p3dn.24xlarge, 8 x V100, 100 Gb/s per node", 125e12, 100e9 / 8,
                         source="NVIDIA V100 datasheet (125 TFLOPS tensor); AWS p3dn.24xlarge (100 Gbps "
                                "networking per instance)"),
}


@dataclass(frozen=True)
class Calibration:
    """The arithmetic of :func:`calibrate`, every figure kept so :meth:`explain` can show it."""

    cluster: Cluster
    world_size: int
    step_flops: float
    step_seconds: float

    @property
    def here_flops(self) -> float:
        """FLOP/s one rank achieves here (its step's FLOPs over the step's time)."""
        return self.step_flops / self.step_seconds

    @property
    def slowdown(self) -> float:
        """How many times slower one rank computes here than one device of the cluster."""
        return self.cluster.achieved_flops / self.here_flops

    @property
    def per_rank_bits(self) -> float:
        """The link one rank needs here for the cluster's bytes per FLOP."""
        return self.cluster.link_bits / self.slowdown

    @property
    def rate(self) -> int:
        """The shared loopback's rate: N ranks' links in one queue (the model of :mod:`mindzero.launch.link`)."""
        return max(8000, int(self.per_rank_bits * self.world_size))

    def explain(self) -> str:
        c = self.cluster
        return "\n".join([
            f"cluster: {c.name} ({c.source})",
            f"  one device achieves {c.peak_flops / 1e12:g} TFLOP/s peak x {c.mfu:g} MFU = "
            f"{c.achieved_flops / 1e12:.1f} TFLOP/s; its link is {c.link_bits / 1e9:g} Gbit/s",
            f"  bytes per FLOP on the cluster: {c.link_bits / 8:.3g} B/s / {c.achieved_flops:.3g} FLOP/s = "
            f"{c.link_bits / 8 / c.achieved_flops:.3g}",
            f"here: one rank's step is {self.step_flops / 1e9:.2f} GFLOP in {self.step_seconds:.2f} s = "
            f"{self.here_flops / 1e9:.3g} GFLOP/s, {self.slowdown:,.0f}x slower than one device",
            f"  the same bytes per FLOP here: {c.link_bits / 1e9:g} Gbit/s / {self.slowdown:,.0f} = "
            f"{self.per_rank_bits / 1e6:.3g} Mbit/s per rank",
            f"  one shared loopback for {self.world_size} ranks: {self.world_size} x {self.per_rank_bits / 1e6:.3g} = "
            f"{self.rate / 1e6:.3g} Mbit/s  ->  --link-rate {max(1, round(self.rate / 1e3))}kbit",
        ])


def calibrate(step_flops: float, step_seconds: float, world_size: int, cluster="dgx-a100") -> Calibration:
    """The shared-link rate at which ``world_size`` ranks of this machine, each doing ``step_flops`` in
    ``step_seconds``, have the compute-to-link ratio of ``cluster`` (a :data:`CLUSTERS` name or a
    :class:`Cluster`). Pure arithmetic: :meth:`Calibration.explain` shows it."""
    if isinstance(cluster, str):
        if cluster not in CLUSTERS:
            raise ValueError(f"cluster={cluster!r}: must be one of {sorted(CLUSTERS)} or a Cluster")
        cluster = CLUSTERS[cluster]
    for name, value in (("step_flops", step_flops), ("step_seconds", step_seconds)):
        if not value > 0:
            raise ValueError(f"{name}={value!r}: must be > 0")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    return Calibration(cluster, world_size, float(step_flops), float(step_seconds))


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
    ap.add_argument("--results", default=str(ROOT / "docs" / "results" / "zero_bench_results.json"))
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

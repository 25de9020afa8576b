"""What a quantized stage-3 read costs apart from its collective: compile time, graph kernels and memory of the
encode and decode around an identity "gather", for the CPU wire (int8 bytes packed into int32 words, as
MindSpore 2.10's CPU all-gather needs) against the GPU/Ascend wire (int8 as it is) and an exact read.

    .venv/bin/python benchmarks/quant_decode_cost.py [--weights 12 --rows 3072 --cols 768] [--out runs/quant_decode]

One process per wire (a fresh process each: RSS and compile caches are per process), the same network: a sum over
``--weights`` weights of ``rows x cols`` fp32, each read once through the path, in graph mode, forward only.
Prints and writes ``results.json``: time to the first call (compile + run), a later call, the peak RSS above the
RSS before building, and the kernels in the compiled graph (``MS_DEV_SAVE_GRAPHS``' executed graph, counted
per primitive kind). No collective runs: the difference is the kernels the wire needs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from zero_bench_worker import reset_peak, status_kib  # noqa: E402

WIRES = ("exact", "int8_wire", "int32_wire")


def rss_mib() -> float:
    return status_kib("VmRSS") / 1024


def peak_mib() -> float:
    """The peak RSS since the last :func:`reset_peak` (``VmHWM``)."""
    return status_kib("VmHWM") / 1024


def kernels(ir_dir: str) -> Counter:
    """Primitive kinds of the graph's nodes, from the ``*.ir`` MindSpore saved with the most primitive nodes (the
    saved stages differ in what they have inlined or folded; the largest is the one the kernels come from)."""
    best = Counter()
    for path in Path(ir_dir).rglob("*.ir"):
        got = Counter()
        for line in path.read_text(errors="replace").splitlines():
            line = line.strip()
            if line.startswith("%") and "= Prim" in line:
                got[line.split("= ", 1)[1].split("(", 1)[0].replace("PrimFunc_", "")] += 1
        if sum(got.values()) > sum(best.values()):
            best = got
    return best


def one(wire: str, weights: int, rows: int, cols: int) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    from mindzero.comm.quantize import Decoder, encode

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    base = rss_mib()
    reset_peak()
    block = 256
    numel = rows * cols
    nb = -(-numel // block)

    class Reads(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.RandomState(0)
            self.ws = ms.ParameterTuple([Parameter(Tensor(rng.randn(numel).astype(np.float32) * 0.02), name=f"w{i}")
                                         for i in range(weights)])
            self.decoders = nn.CellList([Decoder(block, nb, numel, wire == "int8_wire") for _ in range(weights)])

        def construct(self, x):
            out = x
            for i in range(weights):
                w = self.ws[i]
                if wire == "exact":
                    v = w * 1.0
                else:
                    sent = encode(w, block, nb, wire == "int8_wire")
                    got, bits = self.decoders[i].receive(sent, 1)
                    v = self.decoders[i].decode(got, bits, ms.float32)
                out = out + ops.reduce_sum(v)
            return out

    net = Reads()
    built = rss_mib()
    x = Tensor(np.zeros((), np.float32))
    with tempfile.TemporaryDirectory() as ir:
        ms.set_context(save_graphs=1, save_graphs_path=ir)
        t = time.time()
        first = net(x).asnumpy()
        first_s = time.time() - t
        ms.set_context(save_graphs=0)
        counted = kernels(ir)
    t = time.time()
    again = net(x).asnumpy()
    step_s = time.time() - t
    assert np.isfinite(first) and first == again
    return dict(wire=wire, weights=weights, numel=numel, weight_mib=weights * numel * 4 / 2 ** 20,
                first_call_s=first_s, call_s=step_s, built_mib=built - base, peak_above_base_mib=peak_mib() - base,
                kernels=sum(counted.values()), kernel_kinds=dict(counted.most_common()), value=float(first))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", type=int, default=12)
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--out", default="runs/quant_decode")
    ap.add_argument("--one", choices=WIRES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.weights, a.rows, a.cols)))
        return 0
    rows = []
    for wire in WIRES:
        cmd = [sys.executable, __file__, "--one", wire, "--weights", str(a.weights), "--rows", str(a.rows),
               "--cols", str(a.cols)]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
        if got.returncode or not line:
            sys.exit(f"{wire}: exit {got.returncode}\n{got.stderr[-3000:]}")
        rows.append(json.loads(line[0][len("RESULT "):]))
    exact = rows[0]
    print(f"{a.weights} weights of {a.rows} x {a.cols} fp32 ({exact['weight_mib']:.0f} MiB), each read once, forward only")
    print("| read | first call s | vs exact | later call s | peak above base MiB | vs exact | kernels in the graph |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['wire']} | {r['first_call_s']:.2f} | {r['first_call_s'] / exact['first_call_s']:.2f}x | "
              f"{r['call_s']:.3f} | {r['peak_above_base_mib']:.0f} | "
              f"{r['peak_above_base_mib'] / exact['peak_above_base_mib']:.2f}x | {r['kernels']} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"wrote {out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host memory a MindSpore CPU kernel keeps for the life of its compiled graph, per kind of kernel.

One process per kernel (graph mode, CPU): a graph that applies the kernel to 16M-element tensors (64 MiB in
fp32 or int32) and sums the result, compiled and run once, glibc's free memory trimmed, run twice more; the
table is the RSS after that minus the RSS of a graph that only sums (`none`). An output-sized kernel costs
about 64 MiB (its output in the memory pool); anything above is the kernel's own memory (index tables).
Written for the quantized gather, whose first version held 6.9 GiB a rank on a 35M-parameter GPT.

    .venv/bin/python benchmarks/cpu_kernel_memory.py [--out runs/cpu_kernel_memory]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

N = 1 << 24
KERNELS = {
    "none": "f.sum()",
    "float32 Mul, same shape": "(f * x).sum()",
    "float32 Mul by a scalar": "(f * 3.0).sum()",
    "float32 Sub, same shape": "(f - x).sum()",
    "float32 Div (Python /), same shape": "(f / x).sum()",
    "float32 RealDiv, same shape": "ops.RealDiv()(f, x).sum()",
    "float32 Mul, broadcast (rows x column)": "(f.reshape((-1, 256)) * x[: N // 256].reshape((-1, 1))).sum()",
    "float32 Floor": "ops.floor(f).sum()",
    "float32 Round": "ops.round(f).sum()",
    "float32 Tile": "ops.tile(f[: N // 2].reshape((1, -1)), (2, 1)).sum()",
    "float32 Stack of 4 (axis 1)": "ops.stack((f, f, f, f), 1).sum()",
    "float32 Concat (axis 0)": "ops.concat((f, f)).sum()",
    "float32 StridedSlice, 2-D": "f.reshape((2, -1))[:, : N // 2 - 1024].sum()",
    "float32 Transpose": "ops.transpose(f.reshape((4, -1)), (1, 0)).sum()",
    "Cast int32 -> float32": "ops.cast(w, ms.float32).sum()",
    "Cast int32 -> uint16 -> float32": "ops.cast(ops.cast(w, ms.uint16), ms.float32).sum()",
    "int32 Sub, same shape": "(w - w).sum()",
    "int32 Mul by a scalar": "(w * 256).sum()",
    "int32 FloorMod by a scalar": "ops.floor_mod(w, 256).sum()",
    "int32 FloorDiv by a scalar": "ops.floor_divide(w, 256).sum()",
    "int32 Stack of 3 (axis 1)": "ops.stack((w, w, w), 1).sum()",
}

WORKER = '''
import ctypes, sys, numpy as np, mindspore as ms
from mindspore import ops, nn, Tensor
ms.set_context(mode=ms.GRAPH_MODE)
N = {n}
class K(nn.Cell):
    def construct(self, x, w, f):
        return {expr}
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024
x = Tensor(np.ones(N, np.float32))
w = Tensor(np.arange(N, dtype=np.int32))
f = Tensor(np.random.default_rng(0).standard_normal(N).astype(np.float32))
k = K()
k(x, w, f)
ctypes.CDLL("libc.so.6").malloc_trim(0)
k(x, w, f)
k(x, w, f)
print("RSS_MIB", rss())
'''


def measure(expr: str) -> int:
    source = WORKER.format(n=N, expr=expr)
    path = Path(__file__).with_name("_cpu_kernel_memory_worker.py")  # graph mode parses a real file
    path.write_text(source)
    try:
        out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, check=True)
    finally:
        path.unlink(missing_ok=True)
    return int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("RSS_MIB")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/cpu_kernel_memory")
    a = ap.parse_args(argv)
    rows = {name: measure(expr) for name, expr in KERNELS.items()}
    base = rows.pop("none")
    lines = ["| kernel (16M elements) | RSS above a sum-only graph, MiB |", "|---|---|"]
    lines += [f"| {name} | {value - base} |" for name, value in rows.items()]
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"base_rss_mib": base, "rss_mib": rows}, indent=1))
    (out / "results.md").write_text(table + "\n")
    print(f"wrote {out}/results.json, results.md")


if __name__ == "__main__":
    main()

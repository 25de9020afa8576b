"""Peak memory and time of mindzero-merge on a large synthetic checkpoint (no MindSpore needed).

    .venv/bin/python benchmarks/merge_bench.py [--mib 256] [--ranks 4] [--out runs/merge_bench]

Writes a stage-3 checkpoint of ``--mib`` MiB of fp32 parameters, saved as by ``--ranks`` ranks
(shards with padding), then merges it in a child process and reports the child's peak RSS
(``ru_maxrss``) next to a child that only imports the tools, and the largest tensor.
Also times ``mindzero-verify`` on it. Prints a markdown table and writes ``results.json``.
"""
import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mindzero.checkpoint.tensor_io import open_writer  # noqa: E402
from mindzero.core.checksum import crc32_array  # noqa: E402
from mindzero.core.plan import ParamInfo, PartitionPlan  # noqa: E402
from mindzero.checkpoint.format import SplitInfo, TensorEntry, split_info_name, write_marker  # noqa: E402


def make_checkpoint(directory: Path, mib: int, ranks: int) -> tuple:
    """Tensors of 1M..8M elements plus odd shapes, totalling ``mib`` MiB; returns (bytes, largest tensor bytes)."""
    shapes, total = [], 0
    i = 0
    while total < mib << 20:
        shape = [(1024, 1024), (2048, 1023), (4097, 2048), (333, 777)][i % 4]
        shapes.append((f"layer{i}.weight", shape))
        total += int(np.prod(shape)) * 4
        i += 1
    plan = PartitionPlan.build([ParamInfo(n, s) for n, s in shapes], ranks, 0)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for r in range(ranks):
        specs = [s.for_rank(r) for s in plan]
        layout = [(s.name, "float32", (s.shard_size,)) for s in specs]
        crcs = {}
        with open_writer(directory / f"rank_{r}.ckpt", "ckpt", layout) as w:
            for s in specs:
                piece = rng.standard_normal(s.shard_size, dtype=np.float32)
                crcs[s.name] = crc32_array(piece)
                w.write(s.name, piece, "float32")
        entries = tuple(TensorEntry(s.name, "parameter", s.name, s.shape, "float32", True, "", s.shard_size,
                                    s.padding, s.offset, f"rank_{r}.ckpt", s.name, crcs[s.name]) for s in specs)
        SplitInfo("bench", 3, ranks, r, 0, "ckpt", plan.fingerprint(), entries).write(directory / split_info_name(r))
    write_marker(directory, run_id="bench", step=0, group_size=ranks)  # with checksums: merge verifies them
    return total, max(int(np.prod(s)) * 4 for _, s in shapes)


def child_peak(code: str) -> tuple:
    """Run ``code`` in a fresh interpreter; its peak RSS (MiB) and wall time (s)."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", "import resource, sys; " + code +
                           "; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                                               "PATH": "/usr/bin:/bin"})
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return int(proc.stdout.strip().splitlines()[-1]) / 1024, time.time() - start, proc.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default="runs/merge_bench")
    a = ap.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    total, largest = make_checkpoint(out / "ckpt", a.mib, a.ranks)
    base, _, _ = child_peak("import numpy, mindzero.checkpoint.offline")
    peak, secs, text = child_peak(f"from mindzero.checkpoint.offline import merge_checkpoint; "
                                  f"merge_checkpoint('{out / 'ckpt'}', '{out / 'merged.ckpt'}')")
    vpeak, vsecs, _ = child_peak(f"from mindzero.checkpoint.offline import verify_checkpoint; "
                                 f"assert verify_checkpoint('{out / 'ckpt'}')['ok']")
    size = (out / "merged.ckpt").stat().st_size
    res = {"checkpoint_mib": total / 2**20, "ranks": a.ranks, "largest_tensor_mib": largest / 2**20,
           "merged_file_mib": size / 2**20, "merge_peak_rss_mib": peak, "import_only_rss_mib": base,
           "merge_extra_rss_mib": peak - base, "merge_seconds": secs,
           "verify_peak_rss_mib": vpeak, "verify_seconds": vsecs, "summary": text.strip().splitlines()[-2]}
    print("| checkpoint | ranks | largest tensor | merge peak RSS | of which above imports | merge time (checksums "
          "verified) | mindzero-verify time | verify peak RSS above imports |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {total / 2**20:.0f} MiB | {a.ranks} | {largest / 2**20:.1f} MiB | {peak:.0f} MiB | "
          f"{peak - base:.0f} MiB | {secs:.1f} s | {vsecs:.1f} s | {vpeak - base:.0f} MiB |")
    (out / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

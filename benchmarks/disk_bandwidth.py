"""The disk bandwidth disk offload can expect on this machine, measured the way it does its I/O.

    .venv/bin/python benchmarks/disk_bandwidth.py --dir runs/offload_105m --mib 200 --streams 4

``streams`` threads each write a file of ``--mib`` MiB in 8 MiB pieces through
:class:`mindzero.core.offload.StateFile` (``pwrite``, ``fdatasync`` every 64 MiB, the page cache dropped) and read it
back (``pread``, dropped after each read), as the ranks of one machine do in an update; then ``dd`` with
``oflag=direct`` / ``iflag=direct`` (no page cache) over one file of the same size, as a cross-check. Prints MiB/s
and writes ``disk_bandwidth.json`` under ``--dir``. Run it alone: other I/O or CPU load lowers it.
"""
import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.core.offload import StateFile  # noqa: E402

PIECE = 8 * 2 ** 20


def through_state_file(directory: Path, nbytes: int, streams: int) -> dict:
    """Aggregate write and read MiB/s of ``streams`` threads, each writing then reading ``nbytes``."""
    files = [StateFile(directory / f"bandwidth_{i}.bin", nbytes) for i in range(streams)]
    buf = np.random.default_rng(0).integers(0, 255, PIECE, dtype=np.uint8)
    barrier = threading.Barrier(streams)
    times = {}

    def work(i, what):
        barrier.wait()
        t = time.perf_counter()
        f = files[i]
        mine = np.empty(PIECE, np.uint8)
        for at in range(0, nbytes, PIECE):
            n = min(PIECE, nbytes - at)
            if what == "write":
                f.write(buf[:n], at)
            else:
                f.read(mine[:n], at)
        if what == "write":
            f.flush()
        times[(i, what)] = time.perf_counter() - t

    out = {}
    for what in ("write", "read"):
        threads = [threading.Thread(target=work, args=(i, what)) for i in range(streams)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        out[f"{what}_mib_s"] = streams * nbytes / 2 ** 20 / (time.perf_counter() - t)
    for f in files:
        f.close()
    return out


def with_dd(directory: Path, nbytes: int) -> dict:
    """``dd`` write and read of one file with O_DIRECT (MiB/s), or ``{}`` where dd or O_DIRECT is refused."""
    path, count = directory / "bandwidth_dd.bin", max(1, nbytes // PIECE)
    out = {}
    try:
        for what, cmd in (("write", ["dd", "if=/dev/zero", f"of={path}", f"bs={PIECE}", f"count={count}",
                                     "oflag=direct", "conv=fdatasync"]),
                          ("read", ["dd", f"if={path}", "of=/dev/null", f"bs={PIECE}", "iflag=direct"])):
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            out[f"dd_{what}_mib_s"] = count * PIECE / 2 ** 20 / (time.perf_counter() - t)
    except (OSError, subprocess.CalledProcessError):
        return {}
    finally:
        path.unlink(missing_ok=True)
    return out


def measure(directory, mib: float, streams: int) -> dict:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(mib * 2 ** 20)
    result = dict(mib_per_stream=mib, streams=streams, **through_state_file(directory, nbytes, streams),
                  **with_dd(directory, nbytes))
    # one update reads and writes each byte once: its I/O time at these rates (all streams at once)
    result["update_io_s"] = nbytes / 2 ** 20 * streams * (1 / result["write_mib_s"] + 1 / result["read_mib_s"])
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="runs/disk_bandwidth")
    ap.add_argument("--mib", type=float, default=200, help="MiB per stream (a rank's optimizer states)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams (the ranks of one machine)")
    a = ap.parse_args(argv)
    result = measure(a.dir, a.mib, a.streams)
    for k, v in result.items():
        print(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}")
    Path(a.dir, "disk_bandwidth.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

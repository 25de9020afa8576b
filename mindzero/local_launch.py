"""Run a script on several local ranks with ``msrun``: a timeout, a free port, and the failing rank's log.

``python -m mindzero.local_launch -n 2 [--timeout S] [--out DIR] SCRIPT [ARGS...]``

The script gets ``--out DIR`` appended and must write ``DIR/rank_<r>.done`` when it
finishes; a rank without it, a non-zero exit or a timeout (every process is then
killed) fails the launch with that rank's log tail. No launch waits forever.
Used by the tests and the README's main command.
"""
import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free right now on loopback (picked at run time so launches never collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """Kill msrun and every process it started: its workers run in sessions of their own,
    so killing msrun's process group alone leaves them behind."""
    import psutil  # a MindSpore dependency

    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    keep = [l for l in text if not l.startswith("[WARNING]")] or text
    return "\n".join(keep[-lines:])


def msrun(script, world_size: int, out_dir, args=(), timeout: float = 900.0) -> Path:
    """Run ``script`` on ``world_size`` local ranks; return ``out_dir`` once every rank wrote its done-marker.

    Raises:
        AssertionError: a rank failed, the launch timed out (all processes are killed), or a rank
            did not finish; the message carries that rank's log tail.
    """
    out_dir = Path(out_dir)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    msrun_bin = Path(sys.executable).with_name("msrun")
    cmd = [str(msrun_bin), f"--worker_num={world_size}", f"--local_worker_num={world_size}",
           f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True", "--cluster_time_out=120",
           str(script), "--out", str(out_dir), *map(str, args)]
    # msrun starts workers with the `python` on PATH: make it this interpreter
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOG_v="3", MALLOC_MMAP_THRESHOLD_="1048576")
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=out_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        launcher_out, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        launcher_out, _ = proc.communicate()
        timed_out = True
    missing = [r for r in range(world_size) if not (out_dir / f"rank_{r}.done").exists()]
    if timed_out or proc.returncode != 0 or missing:
        logs = {r: log_dir / f"worker_{r}.log" for r in range(world_size)}
        raised = [r for r, p in logs.items() if p.exists() and "Traceback" in p.read_text(errors="replace")]
        bad = (raised or missing or [0])[0]  # the rank that raised, not a bystander waiting for it
        why = (f"timed out after {timeout:.0f}s" if timed_out else f"exit status {proc.returncode}")
        raise AssertionError(
            f"msrun {Path(script).name} on {world_size} ranks failed ({why}; ranks without results: {missing}).\n"
            f"--- log tail of rank {bad} ({log_dir / f'worker_{bad}.log'}) ---\n{_tail(log_dir / f'worker_{bad}.log')}\n"
            f"--- msrun output ---\n{launcher_out[-3000:]}")
    print(f"msrun {Path(script).name} x{world_size}: {time.time() - start:.0f}s")
    return out_dir


def rank_output(out_dir, rank: int = 0) -> str:
    """What ``rank`` printed, without MindSpore's log lines."""
    path = Path(out_dir) / "logs" / f"worker_{rank}.log"
    return "\n".join(l for l in path.read_text(errors="replace").splitlines()
                     if not l.startswith(("[WARNING]", "[INFO]", "[ERROR]", "[DEBUG]")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nproc", type=int, default=2, help="ranks (local workers)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before every process is killed")
    ap.add_argument("--out", default="runs/latest", help="output directory (logs in OUT/logs)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    # ranks run with OUT as working directory (MindSpore drops its dumps there): absolute paths for files
    args = [str(Path(x).resolve()) if not x.startswith("-") and Path(x).exists() else x for x in a.args]
    try:
        msrun(Path(a.script).resolve(), a.nproc, out, args, a.timeout)
    except AssertionError as err:
        print(err, file=sys.stderr)
        return 1
    print(rank_output(out, 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

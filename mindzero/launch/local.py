"""Run a script on several local ranks (``msrun``, one or several loopback "nodes", or ``mpirun``)
with a timeout, a free port, and the log of the rank that failed first.

``python -m mindzero.launch.local -n 2 [--nodes K] [--launcher msrun|mpirun] [--timeout S] [--out DIR] SCRIPT [ARGS...]``

The worker protocol: the script gets ``--out DIR`` appended and must write ``DIR/rank_<r>.done`` when it
finishes (:func:`mindzero.launch.worker.start_worker` and ``Worker.finish`` do both for a script); a rank without it, a
non-zero exit or a timeout (every process is then killed) fails the launch, naming the rank that failed
first and showing its log tail. No launch waits forever. Used by the tests, the examples, the benchmarks
and the README's main command.
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# the directory holding this mindzero package (a source checkout or site-packages): workers import this copy
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("msrun", "mpirun")
# after one launcher process failed, how long the others (other "nodes") get to end on their own
GRACE = 90.0


def free_port() -> int:
    """A TCP port free right now on loopback (picked at run time so launches never collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """Kill a launcher and every process it started: msrun's workers run in sessions of their own,
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


def tree_rss(pids) -> int:
    """Bytes of RSS of the processes ``pids`` and all their descendants (a job's memory on this host)."""
    import psutil

    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    return total


@dataclass
class MemoryWatch:
    """Watch a job's memory (:func:`launch`): its processes' RSS summed, sampled every 0.5 s; ``peak_rss``
    receives the highest total; over ``limit`` bytes (if set) the job is killed."""

    limit: Optional[int] = None
    peak_rss: int = 0


class MemoryLimitExceeded(AssertionError):
    """The job's processes together held more RSS than its :class:`MemoryWatch` limit; every process was
    killed."""

    def __init__(self, message: str, peak: int):
        super().__init__(message)
        self.peak = peak


def _record_ranks(pids, ranks: dict) -> None:
    """Remember which process is which rank (from the RANK_ID / OMPI_COMM_WORLD_RANK each one was given)."""
    import psutil

    for pid in pids:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in children:
            if child.pid in ranks:
                continue
            try:
                env = child.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rank = env.get("RANK_ID") or env.get("OMPI_COMM_WORLD_RANK")
            if rank is not None and env.get("MS_ROLE", "MS_WORKER") == "MS_WORKER":
                ranks[child.pid] = int(rank)


def rank_log(out_dir, rank: int) -> Path:
    """The file holding what ``rank`` printed (msrun: ``worker_<r>.log``; mpirun: ``rank.<r>/stdout``)."""
    logs = Path(out_dir) / "logs"
    for path in (logs / f"worker_{rank}.log", *logs.glob(f"node*/worker_{rank}.log"),
                 *logs.glob(f"mpi/*/rank.{rank}/stdout")):
        if path.exists():
            return path
    return logs / f"worker_{rank}.log"


def _log_text(out_dir, rank: int) -> str:
    path = rank_log(out_dir, rank)
    text = path.read_text(errors="replace") if path.exists() else ""
    err = path.with_name("stderr")
    if path.name == "stdout" and err.exists():
        text += err.read_text(errors="replace")
    return text


def _tail(out_dir, rank: int, lines: int = 60) -> str:
    text = _log_text(out_dir, rank).splitlines()
    if not text:
        return f"(no log at {rank_log(out_dir, rank)})"
    keep = [l for l in text if not l.startswith(("[WARNING]", "[INFO]"))] or text
    return "\n".join(keep[-lines:])


_MSRUN_EXIT = re.compile(r"\):(\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d\.\d+).*Worker process (\d+) exit with exception\. "
                         r"Error code: (-?\d+)")
_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_MPI_EXIT = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*Exit code:\s*(\d+)")


def first_failure(launcher_out: str, pid_ranks: dict):
    """``(rank, how)`` of the rank that failed first according to the launchers' own reports, or None.

    msrun logs ``Worker process PID exit with exception. Error code: C`` (C < 0: killed by signal -C),
    stamped with the time; mpirun names the rank itself.
    """
    seen = []
    for stamp, pid, code in _MSRUN_EXIT.findall(launcher_out):
        if int(pid) in pid_ranks:
            code = int(code)
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            seen.append((stamp, pid_ranks[int(pid)], how))
    if seen:
        _, rank, how = min(seen)
        return rank, how
    m = _MPI_SIGNAL.search(launcher_out)
    if m:
        return int(m.group(1)), f"killed by signal {m.group(2)}"
    m = _MPI_EXIT.search(launcher_out)
    if m:
        return int(m.group(1)), f"exit status {m.group(2)}"
    return None


def _env(extra=None) -> dict:
    # msrun starts workers with the `python` on PATH: make it this interpreter
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{PACKAGE_PARENT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOG_v="3", MALLOC_MMAP_THRESHOLD_="1048576")
    env.update(extra or {})  # the caller's values win
    return env


def _commands(launcher, script, world_size, nodes, out_dir, args, env):
    port = free_port()
    tail = [str(script), "--out", str(out_dir), *map(str, args)]
    logs = out_dir / "logs"
    if launcher == "msrun":
        if nodes < 1 or world_size % nodes:
            raise ValueError(f"nodes={nodes}: must be a positive divisor of world_size={world_size}")
        msrun_bin = str(Path(sys.executable).with_name("msrun"))
        return [[msrun_bin, f"--worker_num={world_size}", f"--local_worker_num={world_size // nodes}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", f"--node_rank={node}",
                 f"--log_dir={logs / f'node{node}' if nodes > 1 else logs}", "--join=True",
                 "--cluster_time_out=120", *tail] for node in range(nodes)]
    if nodes != 1:
        raise ValueError(f"nodes={nodes}: mpirun launches here run on one host (nodes=1)")
    mpirun_bin = shutil.which("mpirun")
    if mpirun_bin is None:
        raise FileNotFoundError("launcher='mpirun': no mpirun on PATH (install Debian's openmpi-bin; "
                                "scripts/setup_env.sh does)")
    env["MS_SCHED_PORT"] = str(port)
    exported = [x for name in ("PATH", "PYTHONPATH", "GLOG_v", "MALLOC_MMAP_THRESHOLD_", "MS_SCHED_PORT",
                               *[k for k in env if k.startswith(("MS_", "MINDZERO_"))])
                for x in ("-x", name)]
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [[mpirun_bin, *root, "--oversubscribe", "-n", str(world_size), "--output-filename",
             str(logs / "mpi"), *exported, sys.executable, "-m", "mindzero.launch", "--log-dir", str(logs), *tail]]


def _lost_scheduler_race(out_dir, node: int, node_out: str) -> bool:
    """On one host every msrun sees ``master_addr`` as local and starts a scheduler; all but the
    first fail to bind the port and exit, and their msrun then exits with status 1 although its
    workers (served by the first scheduler) finished. Only that exact case is forgiven."""
    sched = Path(out_dir) / "logs" / f"node{node}" / "scheduler.log"
    return (sched.exists() and "Failed to init the tcp server" in sched.read_text(errors="replace")
            and "Worker process" not in node_out and "Scheduler process" in node_out)


def launch(script, world_size: int, out_dir, args=(), timeout: float = 900.0, nodes: int = 1,
           launcher: str = "msrun", env=None, memory: MemoryWatch = None) -> Path:
    """Run ``script`` on ``world_size`` local ranks; return ``out_dir`` once every rank wrote its done-marker.

    ``nodes > 1`` (msrun) starts one msrun per "node" on loopback (``--node_rank``), as on a real
    cluster; ``launcher="mpirun"`` starts ``mpirun -n N python -m mindzero.launch SCRIPT``.
    ``env`` adds environment variables (e.g. ``MS_NODE_TIMEOUT``). ``memory``: a :class:`MemoryWatch`
    that receives the job's peak RSS and kills the job above its limit.

    Raises:
        MemoryLimitExceeded: the job exceeded ``memory_limit``.
        AssertionError: a rank failed, the launch timed out (all processes are killed), or a rank
            did not finish; the message names the rank that failed first and carries its log tail.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: must be one of {LAUNCHERS}")
    out_dir = Path(out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank_*.done"):  # a previous launch's markers must not pass for this one's
        stale.unlink()
    env = _env(env)
    cmds = _commands(launcher, script, world_size, nodes, out_dir, args, env)
    start = time.time()
    outs = [open(out_dir / "logs" / f"launcher_{i}.out", "w") for i in range(len(cmds))]
    procs = [subprocess.Popen(cmd, cwd=out_dir, env=env, stdout=o, stderr=subprocess.STDOUT,
                              start_new_session=True, text=True) for cmd, o in zip(cmds, outs)]
    pid_ranks, timed_out, failed_at, peak = {}, False, None, 0
    while any(p.poll() is None for p in procs):
        _record_ranks([p.pid for p in procs], pid_ranks)
        if memory is not None:
            peak = memory.peak_rss = max(peak, tree_rss([p.pid for p in procs]))
            if memory.limit is not None and peak > memory.limit:
                for p in procs:
                    _kill_tree(p.pid)
                for p, o in zip(procs, outs):
                    p.wait()
                    o.close()
                raise MemoryLimitExceeded(f"{launcher} {Path(script).name} on {world_size} ranks: the job held "
                                          f"{peak / 2 ** 30:.2f} GiB of RSS, over the limit of "
                                          f"{memory.limit / 2 ** 30:.2f} GiB, after {time.time() - start:.0f}s; "
                                          "every process was killed", peak)
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now - start > timeout or (failed_at is not None and now - failed_at > GRACE):
            timed_out = now - start > timeout
            for p in procs:
                _kill_tree(p.pid)
            break
        time.sleep(0.5)
    for p, o in zip(procs, outs):
        p.wait()
        o.close()
    texts = [(out_dir / "logs" / f"launcher_{i}.out").read_text(errors="replace") for i in range(len(cmds))]
    launcher_out = "\n".join(texts)
    codes = [0 if p.returncode and _lost_scheduler_race(out_dir, i, text) else p.returncode
             for i, (p, text) in enumerate(zip(procs, texts))]
    missing = [r for r in range(world_size) if not (out_dir / f"rank_{r}.done").exists()]
    if timed_out or any(codes) or missing:
        first = first_failure(launcher_out, pid_ranks)
        if first is None:  # fall back to the rank that raised, not a bystander waiting for it
            raised = [r for r in range(world_size) if "Traceback" in _log_text(out_dir, r)]
            first = ((raised or missing or [0])[0], "raised" if raised else "did not finish")
        bad, how = first
        why = f"timed out after {timeout:.0f}s" if timed_out else f"exit status {codes}"
        raise AssertionError(
            f"{launcher} {Path(script).name} on {world_size} ranks failed after {time.time() - start:.0f}s "
            f"({why}; ranks without results: {missing}); rank {bad} failed first ({how}).\n"
            f"--- log tail of rank {bad} ({rank_log(out_dir, bad)}) ---\n{_tail(out_dir, bad)}\n"
            f"--- {launcher} output ---\n{launcher_out[-3000:]}")
    print(f"{launcher} {Path(script).name} x{world_size}" + (f" on {nodes} nodes" if nodes > 1 else "")
          + f": {time.time() - start:.0f}s")
    return out_dir


def msrun(script, world_size: int, out_dir, args=(), timeout: float = 900.0, **kw) -> Path:
    """:func:`launch` with msrun on one node."""
    return launch(script, world_size, out_dir, args, timeout, launcher="msrun", **kw)


def rank_output(out_dir, rank: int = 0) -> str:
    """What ``rank`` printed, without MindSpore's log lines."""
    return "\n".join(l for l in _log_text(out_dir, rank).splitlines()
                     if not l.startswith(("[WARNING]", "[INFO]", "[ERROR]", "[DEBUG]")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nproc", type=int, default=2, help="ranks (all nodes together)")
    ap.add_argument("--nodes", type=int, default=1, help="msrun invocations on loopback, one per 'node'")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="msrun")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before every process is killed")
    ap.add_argument("--out", default="runs/latest", help="output directory (logs in OUT/logs)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    # ranks run with OUT as working directory (MindSpore drops its dumps there): absolute paths for files
    args = [str(Path(x).resolve()) if not x.startswith("-") and Path(x).exists() else x for x in a.args]
    try:
        launch(Path(a.script).resolve(), a.nproc, out, args, a.timeout, a.nodes, a.launcher)
    except AssertionError as err:
        print(err, file=sys.stderr)
        return 1
    print(rank_output(out, 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

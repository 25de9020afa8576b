"""Run a script on several local ranks (``msrun``, one or several loopback "nodes", or ``mpirun``)
with a timeout, a free port, and the log of the rank that failed first.

``python -m mindzero.launch.local -n 2 [--nodes K] [--launcher msrun|mpirun] [--timeout S] [--out DIR]
[--link-rate RATE [--link-delay D]] SCRIPT [ARGS...]``

The worker protocol: the script gets ``--out DIR`` appended and must write ``DIR/rank_<r>.done`` when it
finishes (:func:`mindzero.launch.worker.start_worker` and ``Worker.finish`` do both for a script); a rank without it, a
non-zero exit or a timeout (every process is then killed) fails the launch, naming the rank that failed
first and showing its log tail. No launch waits forever. ``--link-rate`` runs the ranks in a private network
namespace whose loopback carries at most RATE (one link shared by all ranks, :mod:`mindzero.launch.link`) and
writes the bytes it carried to ``OUT/link.json``. Used by the tests, the examples, the benchmarks
and the README's main command.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .link import LinkNamespace, LinkShape, LinkUnavailable
from .logs import first_failure, log_tail, log_text, rank_log, rank_output, record_ranks, with_fault

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


def kill_tree(pid: int) -> None:
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


class LaunchError(RuntimeError):
    """A launched job failed: a rank exited with an error or did not finish, or the launch timed out; the
    message names the rank that failed first and carries its log tail."""


class MemoryLimitExceeded(LaunchError):
    """The job's processes together held more RSS than its :class:`MemoryWatch` limit; every process was
    killed."""

    def __init__(self, message: str, peak: int):
        super().__init__(message)
        self.peak = peak


def _env(extra=None) -> dict:
    # msrun starts workers with the `python` on PATH: make it this interpreter
    # PYTHONFAULTHANDLER: a rank killed by a crash signal prints its Python stack, which the failure report names
    # MS_RETRY_INTERVAL_*: a node's registration with the scheduler and its unregistration at exit retry every
    # 1-2 s on loopback instead of MindSpore's longer default (a few seconds off every launch); the environment's
    # own values win
    env = dict({"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "2", **os.environ},
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{PACKAGE_PARENT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GLOG_v="3", MALLOC_MMAP_THRESHOLD_="1048576", PYTHONFAULTHANDLER="1")
    env.update(extra or {})  # the caller's values win
    return env


def _commands(launcher, script, world_size, nodes, out_dir, args, env, as_root=False):
    """The launcher command lines (one per msrun "node"); ``env`` receives mpirun's scheduler port; ``as_root``:
    the processes see themselves as root (a user namespace's mapping)."""
    port = free_port()
    tail = [str(script), "--out", str(out_dir), *map(str, args)]
    logs = out_dir / "logs"
    if launcher == "msrun":
        if world_size % nodes:  # (nodes >= 1: LaunchOptions)
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
    exported = [x for name in ("PATH", "PYTHONPATH", "GLOG_v", "MALLOC_MMAP_THRESHOLD_", "PYTHONFAULTHANDLER",
                               "MS_SCHED_PORT",
                               *[k for k in env if k.startswith(("MS_", "MINDZERO_"))])
                for x in ("-x", name)]
    root = ["--allow-run-as-root"] if as_root or (hasattr(os, "geteuid") and os.geteuid() == 0) else []
    return [[mpirun_bin, *root, "--oversubscribe", "-n", str(world_size), "--output-filename",
             str(logs / "mpi"), *exported, sys.executable, "-m", "mindzero.launch", "--log-dir", str(logs), *tail]]


def _lost_scheduler_race(out_dir, node: int, node_out: str) -> bool:
    """On one host every msrun sees ``master_addr`` as local and starts a scheduler; all but the
    first fail to bind the port and exit, and their msrun then exits with status 1 although its
    workers (served by the first scheduler) finished. Only that exact case is forgiven."""
    sched = Path(out_dir) / "logs" / f"node{node}" / "scheduler.log"
    return (sched.exists() and "Failed to init the tcp server" in sched.read_text(errors="replace")
            and "Worker process" not in node_out and "Scheduler process" in node_out)


@dataclass(frozen=True)
class LaunchOptions:
    """How :func:`launch` runs a job: ``launcher`` (``msrun`` or ``mpirun``), ``nodes`` (msrun invocations on
    loopback, one per "node", ``--node_rank``), ``env`` (added environment variables, e.g. ``MS_NODE_TIMEOUT``)
    ``memory`` (a :class:`MemoryWatch` that receives the job's peak RSS and kills it above its limit) and ``link``
    (a :class:`~mindzero.launch.link.LinkShape`: the ranks run behind a shaped loopback)."""

    launcher: str = "msrun"
    nodes: int = 1
    env: Optional[dict] = None
    memory: Optional[MemoryWatch] = None
    link: Optional[LinkShape] = None

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: must be one of {LAUNCHERS}")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes={self.nodes!r}: must be an int >= 1")
        if self.link is not None and not isinstance(self.link, LinkShape):
            raise TypeError(f"link={self.link!r}: must be a mindzero.launch.link.LinkShape (LinkShape.parse('200mbit'))")


@dataclass
class _Job:
    """A started job: its launcher processes, their output files, and what supervision learnt."""

    procs: list
    outs: list
    start: float
    pid_ranks: dict = field(default_factory=dict)
    timed_out: bool = False


def launch(script, world_size: int, out_dir, args=(), timeout: float = 900.0, **options) -> Path:
    """Run ``script`` on ``world_size`` local ranks; return ``out_dir`` once every rank wrote its done-marker.

    ``options`` are :class:`LaunchOptions`' fields: ``nodes > 1`` (msrun) starts one msrun per "node" on
    loopback, as on a real cluster; ``launcher="mpirun"`` starts ``mpirun -n N python -m mindzero.launch SCRIPT``;
    ``env`` adds environment variables; ``memory`` watches the job's RSS; ``link`` runs every process in a private
    network namespace behind a shaped loopback and writes what it carried to ``out_dir/link.json``.

    Raises:
        LinkUnavailable: ``link`` was asked and this machine cannot make the namespace (says why).
        MemoryLimitExceeded: the job exceeded its memory limit (every process was killed).
        LaunchError: a rank failed, the launch timed out (all processes are killed), or a rank did not
            finish; the message names the rank that failed first and carries its log tail.
    """
    how = LaunchOptions(**options)
    out_dir = Path(out_dir).resolve()  # the ranks run with it as their working directory: a relative path would nest
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank_*.done"):  # a previous launch's markers must not pass for this one's
        stale.unlink()
    (out_dir / "link.json").unlink(missing_ok=True)
    env = _env(how.env)
    space = LinkNamespace(how.link) if how.link is not None else None
    try:
        cmds = _commands(how.launcher, script, world_size, how.nodes, out_dir, args, env,
                         as_root=space is not None and space.userns)
        if space is not None:
            cmds = [space.wrap(cmd) for cmd in cmds]
        outs = [open(out_dir / "logs" / f"launcher_{i}.out", "w") for i in range(len(cmds))]
        job = _Job([subprocess.Popen(cmd, cwd=out_dir, env=env, stdout=o, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True) for cmd, o in zip(cmds, outs)], outs,
                   time.time())
        _supervise(job, timeout, how.memory, f"{how.launcher} {Path(script).name} on {world_size} ranks")
        if space is not None:
            _write_link_record(out_dir, how.link, space.counters(), time.time() - job.start)
    finally:
        if space is not None:
            space.close()
    texts = [(out_dir / "logs" / f"launcher_{i}.out").read_text(errors="replace") for i in range(len(cmds))]
    codes = [0 if p.returncode and _lost_scheduler_race(out_dir, i, text) else p.returncode
             for i, (p, text) in enumerate(zip(job.procs, texts))]
    missing = [r for r in range(world_size) if not (out_dir / f"rank_{r}.done").exists()]
    if job.timed_out or any(codes) or missing:
        launcher_out = "\n".join(texts)
        bad, how_failed = _first_to_fail(out_dir, world_size, launcher_out, job.pid_ranks, missing)
        why = f"timed out after {timeout:.0f}s" if job.timed_out else f"exit status {codes}"
        raise LaunchError(
            f"{how.launcher} {Path(script).name} on {world_size} ranks failed after {time.time() - job.start:.0f}s "
            f"({why}; ranks without results: {missing}); rank {bad} failed first ({how_failed}).\n"
            f"--- log tail of rank {bad} ({rank_log(out_dir, bad)}) ---\n{log_tail(out_dir, bad)}\n"
            f"--- {how.launcher} output ---\n{launcher_out[-3000:]}")
    print(f"{how.launcher} {Path(script).name} x{world_size}" + (f" on {how.nodes} nodes" if how.nodes > 1 else "")
          + f": {time.time() - job.start:.0f}s")
    return out_dir


def _write_link_record(out_dir: Path, shape: LinkShape, counted: dict, seconds: float) -> None:
    """``link.json``: the shape and what the namespace's loopback carried during the job (every rank's bytes)."""
    record = {"rate_bit_s": shape.rate, "delay_ms": shape.delay_ms, "qdisc": shape.qdisc(), "seconds": seconds,
              **counted}
    tmp = out_dir / "link.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out_dir / "link.json")


def _supervise(job: _Job, timeout: float, memory: Optional[MemoryWatch], what: str) -> None:
    """Wait for ``job``'s launchers: record which process is which rank, watch the memory, and kill every
    process at the timeout, ``GRACE`` seconds after a launcher failed, or above the memory limit."""
    failed_at, peak, pids = None, 0, [p.pid for p in job.procs]
    while any(p.poll() is None for p in job.procs):
        record_ranks(pids, job.pid_ranks)
        if memory is not None:
            peak = memory.peak_rss = max(peak, tree_rss(pids))
            if memory.limit is not None and peak > memory.limit:
                _end(job, kill=True)
                raise MemoryLimitExceeded(f"{what}: the job held {peak / 2 ** 30:.2f} GiB of RSS, over the limit of "
                                          f"{memory.limit / 2 ** 30:.2f} GiB, after {time.time() - job.start:.0f}s; "
                                          "every process was killed", peak)
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for p in job.procs):
            failed_at = now
        if now - job.start > timeout or (failed_at is not None and now - failed_at > GRACE):
            job.timed_out = now - job.start > timeout
            break
        time.sleep(0.5)
    _end(job, kill=any(p.poll() is None for p in job.procs))


def _end(job: _Job, kill: bool) -> None:
    if kill:
        for p in job.procs:
            kill_tree(p.pid)
    for p, o in zip(job.procs, job.outs):
        p.wait()
        o.close()


def _first_to_fail(out_dir, world_size: int, launcher_out: str, pid_ranks: dict, missing: list) -> tuple:
    """``(rank, how)``: the launchers' own report (:func:`first_failure`), else the rank that raised, else the
    first rank without results (not a bystander waiting for it)."""
    first = first_failure(launcher_out, pid_ranks)
    if first is None:
        raised = [r for r in range(world_size) if "Traceback" in log_text(out_dir, r)]
        first = ((raised or missing or [0])[0], "raised" if raised else "did not finish")
    return with_fault(first, log_text(out_dir, first[0]))


def msrun(script, world_size: int, out_dir, args=(), timeout: float = 900.0, **options) -> Path:
    """:func:`launch` with msrun."""
    return launch(script, world_size, out_dir, args, timeout, launcher="msrun", **options)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--nproc", type=int, default=2, help="ranks (all nodes together)")
    ap.add_argument("--nodes", type=int, default=1, help="msrun invocations on loopback, one per 'node'")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="msrun")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before every process is killed")
    ap.add_argument("--out", default="runs/latest", help="output directory (logs in OUT/logs)")
    ap.add_argument("--link-rate", help="run the ranks behind a loopback of this rate, shared by all ranks (tc units: "
                                        "200mbit, 1gbit); needs Linux network namespaces (docs/launch.md)")
    ap.add_argument("--link-delay", help="with --link-rate: delay added to every packet (1ms; needs sch_netem)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.link_delay and not a.link_rate:
        ap.error(f"--link-delay {a.link_delay}: needs --link-rate")
    link = LinkShape.parse(a.link_rate, a.link_delay) if a.link_rate else None
    out = Path(a.out).resolve()
    # ranks run with OUT as working directory (MindSpore drops its dumps there): absolute paths for files
    args = [str(Path(x).resolve()) if not x.startswith("-") and Path(x).exists() else x for x in a.args]
    try:
        launch(Path(a.script).resolve(), a.nproc, out, args, a.timeout, nodes=a.nodes, launcher=a.launcher, link=link)
    except (LaunchError, LinkUnavailable) as err:
        print(err, file=sys.stderr)
        return 1
    print(rank_output(out, 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

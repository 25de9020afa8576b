"""Reading a launched job's logs (pure): which process is which rank, where each rank's output is, the rank
that failed first by the launchers' own reports, and what a rank printed."""
from __future__ import annotations

import re
from pathlib import Path


def record_ranks(pids, ranks: dict) -> None:
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


def log_text(out_dir, rank: int) -> str:
    path = rank_log(out_dir, rank)
    text = path.read_text(errors="replace") if path.exists() else ""
    err = path.with_name("stderr")
    if path.name == "stdout" and err.exists():
        text += err.read_text(errors="replace")
    return text


def log_tail(out_dir, rank: int, lines: int = 60) -> str:
    text = log_text(out_dir, rank).splitlines()
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


def rank_output(out_dir, rank: int = 0) -> str:
    """What ``rank`` printed, without MindSpore's log lines."""
    return "\n".join(l for l in log_text(out_dir, rank).splitlines()
                     if not l.startswith(("[WARNING]", "[INFO]", "[ERROR]", "[DEBUG]")))

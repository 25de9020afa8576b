"""Reading a launched job's logs (pure): which process is which rank, where each rank's output is, the rank
that failed first by the launchers' own reports, and what a rank printed.

``python -m mindzero.launch.logs JOB.log`` reads what ``mpirun ... python -m mindzero.launch`` printed (saved
with ``2>&1 | tee JOB.log``) and names the rank that failed first, how, and for a crash where its Python was and
the phase (every rank started through ``mindzero.launch`` prints its stack when it crashes); the same from what
``msrun --join=True`` printed (with ``PYTHONFAULTHANDLER=1`` exported before msrun); given one rank's log (msrun's
``worker_<r>.log``), where that rank crashed."""
from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

#: what a rank's death by these signals usually means (the launcher's report names it)
SIGNAL_CAUSES = {"SIGKILL": "sent by the kernel's out-of-memory killer when memory runs out, or by a user",
                 "SIGSEGV": "a crash in native code", "SIGABRT": "an abort in native code",
                 "SIGBUS": "a bad memory access in native code", "SIGTERM": "asked to stop (by a launcher or a user)"}


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
            how = f"killed by {describe_signal(-code)}" if code < 0 else f"exit status {code}"
            seen.append((stamp, pid_ranks[int(pid)], how))
    if seen:
        _, rank, how = min(seen)
        return rank, how
    m = _MPI_SIGNAL.search(launcher_out)
    if m:
        return int(m.group(1)), f"killed by {describe_signal(int(m.group(2)))}"
    m = _MPI_EXIT.search(launcher_out)
    if m:
        return int(m.group(1)), f"exit status {m.group(2)}"
    return None


def describe_signal(number: int) -> str:
    """``"signal 11 (SIGSEGV: a crash in native code)"``."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    cause = SIGNAL_CAUSES.get(name)
    return f"signal {number} ({name}: {cause})" if cause else f"signal {number} ({name})"


_FAULT = re.compile(r"^Fatal Python error: (.+)$", re.M)
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)


def _fault_stack(text: str):
    """``(fault, [(path, line, function)])`` of the thread that faulted, innermost first, from the stack
    ``faulthandler`` printed; ``None`` without one."""
    fault = _FAULT.search(text)
    if fault is None:
        return None
    after = text[fault.end():]
    start = after.find("Current thread")  # the faulting thread's stack, when other threads are listed before it
    return fault.group(1).strip(), _FRAME.findall((after[start:] if start >= 0 else after).split("\n\n")[0])


def fault_location(text: str, frames: int = 4) -> str:
    """Where a rank's Python was when a signal killed it, from the stack ``faulthandler`` printed
    (``PYTHONFAULTHANDLER=1``, set by :mod:`mindzero.launch.local` for every rank): the innermost ``frames`` of
    the thread that faulted, innermost first, e.g. ``"Segmentation fault in crash (worker.py:12) <- first_step
    (worker.py:20)"``; ``""`` without such a stack (a SIGKILL leaves none)."""
    stack = _fault_stack(text)
    if stack is None:
        return ""
    fault, found = stack
    where = " <- ".join(f"{func} ({Path(path).name}:{line})" for path, line, func in found[:frames])
    return fault + (f" in {where}" if where else "")


#: (file, function) of a frame -> the phase a rank was in when it died there; a stack is matched innermost first
PHASES = (
    ("mindspore/communication/management.py", "init", "joining the cluster (mindspore.communication.init)"),
    ("mindzero/engine/offload.py", "update", "the streamed optimizer update (optimizer_offload='disk')"),
    ("mindzero/engine/train_step.py", "compile", "compiling the train step's graph"),
    ("mindzero/engine/train_step.py", "__call__", "running a train step"),
    ("mindzero/checkpoint/save.py", "save_checkpoint", "saving a checkpoint"),
    ("mindzero/checkpoint/live.py", "load_checkpoint", "loading a checkpoint"),
    ("mindzero/engine/prepare.py", "prepare_train_network", "prepare_train_network (sharding the model)"),
)


#: the files of ``python -m mindzero.launch``, whose frames hold every script it runs: no phase of their own
_LAUNCHER_FILES = ("mindzero/launch/mpi.py", "mindzero/launch/__main__.py")


def fault_phase(text: str) -> str:
    """The phase a rank was in when a signal killed it, from its ``faulthandler`` stack (see
    :func:`fault_location`): the innermost frame :data:`PHASES` knows; else whose code it was in; ``""`` without a
    stack."""
    stack = _fault_stack(text)
    if stack is None:
        return ""
    paths = [(path.replace("\\", "/"), func) for path, _, func in stack[1]]
    paths = [(path, func) for path, func in paths if not path.endswith(_LAUNCHER_FILES)]
    for path, func in paths:
        for suffix, name, phase in PHASES:
            if func == name and path.endswith(suffix):
                return phase
    inside = [f"{func} ({Path(path).name})" for path, func in paths if "/mindspore/" in path]
    if inside:
        return f"inside MindSpore ({inside[0]}), outside the phases mindzero names"
    if any("/mindzero/" in path for path, _ in paths):
        return "inside mindzero, outside the phases it names"
    return "the script's own code (no mindzero or MindSpore frame on the stack)"


def with_fault(first: tuple, text: str) -> tuple:
    """``first`` (``(rank, how)``) with, for a crash, where the rank's Python was and the phase added to ``how``,
    from the ``faulthandler`` stack in ``text`` (that rank's output)."""
    rank, how = first
    where = fault_location(text)
    return (rank, f"{how}; {where}; phase: {fault_phase(text)}") if where else first


_MS_RANK = re.compile(r"DISTRIBUTED\((\d+),[^)]*\).*This node \d+ rank id: (\d+)")


def pid_ranks_in(text: str) -> dict:
    """``{pid: rank}`` from MindSpore's own lines in a job's output (``DISTRIBUTED(PID,...) ... This node N rank id:
    R``, which msrun's ``--join`` output repeats from every worker's log)."""
    return {int(pid): int(rank) for pid, rank in _MS_RANK.findall(text)}


def main(argv=None) -> int:
    """Print the failure report of a job from its launcher's output file; exit status 1 if it names no failure."""
    ap = argparse.ArgumentParser(prog="python -m mindzero.launch.logs", description=__doc__.split("\n\n")[1])
    ap.add_argument("output", help="what the launcher printed, e.g. `mpirun ... 2>&1 | tee job.log`")
    a = ap.parse_args(argv)
    text = Path(a.output).read_text(errors="replace")
    first = first_failure(text, pid_ranks_in(text))
    if first is None:
        where = fault_location(text)  # one rank's own log (msrun's worker_<r>.log): its stack, no launcher report
        if where:
            print(f"{a.output}: {where}; phase: {fault_phase(text)}")
            return 0
        print(f"{a.output}: no rank that failed (no launcher report of an exit status or a signal, no crash stack)")
        return 1
    rank, how = with_fault(first, text)
    print(f"rank {rank} failed first ({how})")
    return 0


def rank_output(out_dir, rank: int = 0) -> str:
    """What ``rank`` printed, without MindSpore's log lines."""
    return "\n".join(l for l in log_text(out_dir, rank).splitlines()
                     if not l.startswith(("[WARNING]", "[INFO]", "[ERROR]", "[DEBUG]")))


if __name__ == "__main__":
    sys.exit(main())

"""Join MindSpore's cluster from a process started by ``mpirun`` (or ``srun``).

``mpirun -n N python -m mindzero.launch [--master-addr A] [--master-port P] SCRIPT [ARGS...]``

MindSpore's own MPI path does not work on CPU (``init()`` fails on the device
side), so instead every rank maps the launcher's rank and size onto MindSpore's
dynamic-cluster variables before the script runs (and so before ``init()``):

=================  ==============================================================
``MS_ROLE``        ``MS_WORKER``
``MS_WORKER_NUM``  the launcher's world size
``MS_NODE_ID``     the launcher's rank (``RANK_ID`` too, as msrun sets it)
``MS_SCHED_HOST``  ``--master-addr`` / ``$MS_SCHED_HOST`` / ``127.0.0.1``
``MS_SCHED_PORT``  ``--master-port`` / ``$MS_SCHED_PORT`` / a port derived from the job id
=================  ==============================================================

Rank 0 also starts MindSpore's scheduler (a child process that dies with it).
The rank and size are read from OpenMPI (``OMPI_COMM_WORLD_RANK``/``_SIZE``),
PMI (MPICH, Intel MPI: ``PMI_RANK``/``PMI_SIZE``) or Slurm (``SLURM_PROCID``/
``SLURM_NTASKS``). Under ``msrun`` (``MS_ROLE`` already set) the script just runs.

Without ``--master-port`` every rank derives the same port from the launcher's
job id, below Linux's range of ephemeral ports (so no outgoing connection holds it); two jobs on one host
could still pick the same one, so pass the port explicitly (``-x MS_SCHED_PORT=P`` or ``--master-port P``)
when that matters. Rank 0 fails at once, naming the port, when its host cannot listen on it or the scheduler
exits before it listens: MindSpore's workers would otherwise retry for half an hour.
"""
import argparse
import atexit
import ctypes
import errno
import faulthandler
import hashlib
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# (rank, size, job id) variables of each launcher family, first match wins
LAUNCHER_ENV = (
    ("OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")),
    ("PMI", "PMI_RANK", "PMI_SIZE", ("PMI_JOBID", "PMIX_NAMESPACE")),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_JOB_ID",)),
)
PORT_RANGE = (20000, 32768)  # below Linux's ephemeral ports (ip_local_port_range starts at 32768)
SCHEDULER_WAIT = 60.0  # seconds rank 0 waits for the scheduler to finish after its own worker ended
SCHEDULER_LISTEN_WAIT = 60.0  # seconds rank 0 waits for the scheduler it started to accept connections


def launcher_rank(env=os.environ):
    """``(family, rank, size, job_id)`` of the launcher that started this process.

    Raises:
        RuntimeError: no known launcher variables, or values that are not a rank below a size.
    """
    for family, rank_var, size_var, job_vars in LAUNCHER_ENV:
        if rank_var in env and size_var in env:
            try:
                rank, size = int(env[rank_var]), int(env[size_var])
            except ValueError:
                raise RuntimeError(f"{rank_var}={env[rank_var]!r}, {size_var}={env[size_var]!r}: "
                                   "rank and size must be integers") from None
            if not 0 <= rank < size:
                raise RuntimeError(f"{rank_var}={rank} with {size_var}={size}: the rank must lie in [0, size)")
            job = next((env[v] for v in job_vars if env.get(v)), "")
            return family, rank, size, job
    names = ", ".join(f"{r}/{s}" for _, r, s, _ in LAUNCHER_ENV)
    raise RuntimeError(f"mindzero.launch: no launcher rank variables found (looked for {names}); start it "
                       "with `mpirun -n N python -m mindzero.launch SCRIPT`, or use msrun directly")


def job_port(job_id: str) -> int:
    """A port every rank of one job derives alike from the job id (no communication needed)."""
    digest = int(hashlib.sha256(job_id.encode()).hexdigest(), 16)
    return PORT_RANGE[0] + digest % (PORT_RANGE[1] - PORT_RANGE[0])


def cluster_env(rank: int, size: int, job_id: str, master_addr=None, master_port=None, env=os.environ):
    """The ``MS_*`` variables that make this process worker ``rank`` of a ``size``-rank MindSpore cluster."""
    port = master_port or env.get("MS_SCHED_PORT") or job_port(job_id)
    port = int(port)
    if not 0 < port < 65536:
        raise ValueError(f"master_port={port}: must be a TCP port in (0, 65536)")
    return {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": str(size), "MS_NODE_ID": str(rank), "RANK_ID": str(rank),
            "MS_SCHED_HOST": master_addr or env.get("MS_SCHED_HOST") or "127.0.0.1", "MS_SCHED_PORT": str(port)}


def _die_with_parent():
    """In the child: get SIGTERM when the parent (rank 0) dies, even by ``kill -9``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_scheduler(env: dict, log_path: Path) -> subprocess.Popen:
    """Start MindSpore's scheduler (``MS_ROLE=MS_SCHED``) as a child of rank 0; its output goes to ``log_path``."""
    code = "import mindspore as ms; from mindspore.communication import init; ms.set_device('CPU'); init()"
    sched_env = {**os.environ, **env, "MS_ROLE": "MS_SCHED"}
    sched_env.pop("RANK_ID", None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-c", code], env=sched_env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


def check_port_free(host: str, port: int, given: bool) -> None:
    """Raise ``RuntimeError`` if something on this host already listens on (or holds) ``host:port``, where the
    scheduler is to listen. MindSpore's scheduler then fails to bind (a port held by another listener or by a
    connected client socket) and its workers retry registering for up to half an hour, so the launch would hang.
    ``given``: the port came from the user, not derived from the job id."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except socket.gaierror:
            return  # a name this host cannot resolve: the scheduler reports it
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return  # e.g. not an address of this host: the scheduler reports it
            where = "given" if given else "derived from the job id"
            raise RuntimeError(f"MS_SCHED_PORT={port} ({where}): {host}:{port} is already in use on this host, so "
                               "MindSpore's scheduler cannot listen there; pass a free port (--master-port P or "
                               "mpirun -x MS_SCHED_PORT=P)") from None


def scheduler_failed(scheduler: subprocess.Popen, log_path: Path, host: str, port: int) -> None:
    """Raise ``RuntimeError`` if the scheduler has exited (before any worker could register): its exit code and
    the end of its log."""
    code = scheduler.poll()
    if code is None:
        return
    try:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        tail = "(no log)"
    raise RuntimeError(f"MindSpore's scheduler for {host}:{port} exited with code {code} before the job started "
                       f"(usually: the port is in use, or the address is not one of this host's); the end of "
                       f"{log_path}:\n{tail}")


def wait_for_scheduler(scheduler: subprocess.Popen, host: str, port: int,
                       timeout: float = SCHEDULER_LISTEN_WAIT) -> None:
    """Return once the scheduler accepts connections (or has exited, or ``timeout`` passed). MindSpore's worker
    that tries to register before its scheduler listens keeps failing to connect for several seconds after the
    scheduler is up; the other ranks are not held up."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and scheduler.poll() is None:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)


def run_script(script: str, args) -> None:
    """Run ``script`` in this process as ``__main__`` with ``args`` as its command line."""
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--master-addr", help="host of rank 0, where the scheduler runs (default $MS_SCHED_HOST "
                                          "or 127.0.0.1)")
    ap.add_argument("--master-port", type=int, help="scheduler port (default $MS_SCHED_PORT or one derived from "
                                                    "the launcher's job id)")
    ap.add_argument("--log-dir", default=os.environ.get("MINDZERO_LOG_DIR", "."),
                    help="where rank 0 writes scheduler.log (default $MINDZERO_LOG_DIR or .)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if not faulthandler.is_enabled():  # a rank that crashes prints its Python stack (python -m mindzero.launch.logs)
        faulthandler.enable()
    if os.environ.get("MS_ROLE"):  # started by msrun (or set up by hand): nothing to map
        run_script(a.script, a.args)
        return 0
    family, rank, size, job = launcher_rank()
    env = cluster_env(rank, size, job, a.master_addr, a.master_port)
    port_given = bool(a.master_port or os.environ.get("MS_SCHED_PORT"))
    os.environ.update(env)
    scheduler = None
    if rank == 0:
        host, port, log = env["MS_SCHED_HOST"], int(env["MS_SCHED_PORT"]), Path(a.log_dir) / "scheduler.log"
        check_port_free(host, port, port_given)
        scheduler = start_scheduler(env, log)
        wait_for_scheduler(scheduler, host, port)
        scheduler_failed(scheduler, log, host, port)
        # registered before MindSpore is imported, so it runs after MindSpore's own exit handler
        # has unregistered this worker (the scheduler waits for that before it ends)
        atexit.register(_reap, scheduler)
    try:
        run_script(a.script, a.args)
    except BaseException as err:
        # a script ending with sys.exit(0) / sys.exit(None) succeeded: the scheduler must live on until every
        # other worker has unregistered (killing it made a slower rank fail "to unregister from the meta
        # server node" and mpirun abort the job); any other exception ends the job
        failed = not (isinstance(err, SystemExit) and err.code in (None, 0))
        if failed and scheduler is not None:  # the job is over: do not keep the others waiting on a scheduler
            scheduler.kill()
        raise
    return 0


def _reap(scheduler: subprocess.Popen) -> None:
    try:
        scheduler.wait(SCHEDULER_WAIT)
    except subprocess.TimeoutExpired:
        scheduler.kill()


if __name__ == "__main__":
    sys.exit(main())

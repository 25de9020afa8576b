"""Launch the way users do: msrun on two loopback "nodes", mpirun through ``mindzero.launch``,
and a rank that dies (exception, ``kill -9``, a crash in native code) ends the job, naming that rank, the signal and
where it died, in bounded time.

The parity worker runs under each launcher (mixed net: plain DP and stages 0-3, the
collectives and the plan-mismatch check), so the launchers are checked by training results,
not by "it started".
"""
import json
import shutil
import time

import pytest

from mindzero.launch.local import LaunchError, launch
from tests.support.compare import Results, assert_parity_checks, assert_same_run
from tests.support.models import DEFAULT_OPTIMIZER
from tests.support.scenarios import parity_scenarios
from tests.support.tier import full_tier

from . import WORKERS

# MindSpore's scheduler declares a silent node dead after MS_NODE_TIMEOUT s (default 30); with 10
# the whole job must be over well within DEATH_BOUND s of the death (counted from the victim's own clock
# reading just before it dies: the launch before it took 30-100 s on a busy 2-core machine, which a bound
# counted from the launch mistook for a slow death; the launch timeout, 600 s, is far above)
NODE_TIMEOUT = 10
DEATH_BOUND = 60

LAYOUTS = {"msrun-2nodes": dict(launcher="msrun", nodes=2, n=4), "mpirun": dict(launcher="mpirun", nodes=1, n=2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tmp_path_factory):
    lay = LAYOUTS[request.param]
    if lay["launcher"] == "mpirun" and shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: scripts/setup_env.sh installs Debian's openmpi-bin")
    out = tmp_path_factory.mktemp(request.param)
    scenarios = plain_mixed(lay["n"], full_tier(request.config))
    launch(WORKERS / "worker_parity.py", lay["n"], out, ["--only", ",".join(s.name for s in scenarios)], timeout=900,
           nodes=lay["nodes"], launcher=lay["launcher"])
    return lay["n"], Results(out, scenarios)


#: the stages each launcher trains in the default suite: stage 3 issues every kind of collective the others do
#: (the parity launch runs every stage under msrun); stages 0-2 too in the full tier
DEFAULT_STAGES = (3,)


def plain_mixed(n: int, full: bool = True) -> list:
    """The mixed net with its own optimizer and no other option: plain DP and stages 0-3 (without ``full``: plain DP
    and :data:`DEFAULT_STAGES`)."""
    return [s for s in parity_scenarios(n) if s.model == "mixed" and s.optimizer == DEFAULT_OPTIMIZER["mixed"]
            and not s.settings and not (s.force_overflow or s.substitute)
            and (full or s.stage == "dp" or s.stage in DEFAULT_STAGES)]


def test_collectives_and_plan_mismatch(run):
    assert_parity_checks(run[1], run[0])


@pytest.mark.parametrize("stage", [s if s in DEFAULT_STAGES else pytest.param(s, marks=pytest.mark.full)
                                   for s in (0, 1, 2, 3)])
def test_training_equals_plain_data_parallel(run, stage):
    n, res = run
    for r in range(n):
        assert_same_run(res.load(r, f"mixed-{stage}"), res.load(r, "mixed-dp"), f"stage {stage} rank {r}")


@pytest.mark.parametrize("launcher,nodes,n,victim,mode", [
    ("msrun", 1, 2, 1, "segv"),
    pytest.param("msrun", 2, 4, 3, "raise", marks=pytest.mark.full),   # a rank on the second "node"
    ("mpirun", 1, 2, 1, "kill"),
])
def test_dead_rank_ends_the_job_naming_it(tmp_path, launcher, nodes, n, victim, mode):
    if launcher == "mpirun" and shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: scripts/setup_env.sh installs Debian's openmpi-bin")
    with pytest.raises(LaunchError) as err:
        launch(WORKERS / "worker_fail.py", n, tmp_path, ["--mode", mode, "--victim", victim], timeout=600,
               nodes=nodes, launcher=launcher, env={"MS_NODE_TIMEOUT": str(NODE_TIMEOUT)})
    took = time.time() - float((tmp_path / f"rank_{victim}" / "death").read_text())
    text = str(err.value)
    how = {"kill": "killed by signal 9 (SIGKILL: sent by the kernel's out-of-memory killer",
           "segv": "killed by signal 11 (SIGSEGV: a crash in native code); Segmentation fault in string_at",
           "raise": "exit status 1"}[mode]
    assert f"rank {victim} failed first ({how}" in text, text
    if mode == "segv":  # where it died: the worker's function that crashed, from the rank's faulthandler stack
        assert "<- first_step (worker_fail.py:" in text, text
        assert "phase: the script's own code (no mindzero or MindSpore frame on the stack)" in text, text
    assert "timed out" not in text.split("\n")[0], text  # ended by the launcher, not by our timeout
    assert took < DEATH_BOUND, f"the job took {took:.0f}s to end after rank {victim} died"
    if mode == "raise":
        assert f"deliberate failure on rank {victim}" in text, text


def _users_mpirun(tmp_path, mode: str, env: dict):
    """The docs' command line, ``mpirun -n 2 python -m mindzero.launch worker_fail.py`` (rank 1 failing by ``mode``),
    in ``env`` (the workers' ``PYTHONPATH`` added) with the ranks' output through mpirun's: the finished process."""
    import os
    import subprocess
    import sys

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: scripts/setup_env.sh installs Debian's openmpi-bin")
    root = str(WORKERS.parents[1])  # the workers import tests.support
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))}
    return subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m",
                           "mindzero.launch", "--log-dir", str(tmp_path), str(WORKERS / "worker_fail.py"), "--out",
                           str(tmp_path), "--mode", mode, "--victim", "1"], env=env, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def test_mpirun_with_its_port_in_use_fails_at_once_naming_it(tmp_path):
    """``mpirun ... python -m mindzero.launch`` whose scheduler port another process listens on: rank 0 refuses it
    before starting MindSpore's scheduler and mpirun ends the job (MindSpore's workers alone retried registering
    for half an hour)."""
    import os
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    start = time.monotonic()
    try:
        done = _users_mpirun(tmp_path, "raise", {**os.environ, "MS_SCHED_PORT": str(port)})
    finally:
        holder.close()
    took = time.monotonic() - start
    assert done.returncode != 0, done.stdout
    assert f"MS_SCHED_PORT={port} (given): 127.0.0.1:{port} is already in use on this host" in done.stdout, \
        done.stdout
    assert not (tmp_path / "scheduler.log").exists(), "a scheduler was started on a port in use"
    assert took < 120, f"the job took {took:.0f}s to end"


def test_a_crash_under_a_users_mpirun_line_is_named_from_its_output(tmp_path, capsys):
    """The docs' command line with nothing else (no ``PYTHONFAULTHANDLER``, the ranks' output through mpirun's):
    a rank that crashes in native code prints its Python stack (``mindzero.launch`` turns ``faulthandler`` on), and
    ``python -m mindzero.launch.logs`` names the rank, the signal, the frame and the phase from the saved output."""
    import os

    from mindzero.launch.logs import main

    done = _users_mpirun(tmp_path, "segv", {k: v for k, v in os.environ.items()
                                            if k not in ("PYTHONFAULTHANDLER", "MS_SCHED_PORT")})
    job = tmp_path / "job.log"
    job.write_text(done.stdout)
    assert done.returncode != 0, done.stdout
    assert "Fatal Python error: Segmentation fault" in done.stdout, done.stdout
    assert main([str(job)]) == 0
    report = capsys.readouterr().out
    assert report.startswith("rank 1 failed first (killed by signal 11 (SIGSEGV: a crash in native code); "
                             "Segmentation fault in string_at"), report
    assert "<- first_step (worker_fail.py:" in report, report
    assert "phase: the script's own code (no mindzero or MindSpore frame on the stack)" in report, report


def test_shaped_link_slows_the_collectives_by_the_bytes_over_the_rate(tmp_path):
    """``link=``: the ranks run behind a loopback of 200 Mbit/s shared by all of them. The all-reduces take at
    least the ring's bytes over the rate (unshaped they take milliseconds here) and the namespace's counter saw at
    least those bytes."""
    from mindzero.launch.link import LinkShape, LinkUnavailable, check_link_support

    shape = LinkShape.parse("200mbit")
    try:
        check_link_support(shape)
    except LinkUnavailable as err:
        pytest.skip(f"no shaped link on this machine: {err}")
    n, mib, reps = 2, 4.0, 3
    launch(WORKERS / "worker_link.py", n, tmp_path, ["--mib", mib, "--reps", reps], timeout=300, link=shape)
    payload = mib * 2 ** 20
    ring = n * 2 * (n - 1) / n * payload  # bytes all ranks send for one all-reduce, at the least
    counted = json.loads((tmp_path / "link.json").read_text())
    assert counted["rate_bit_s"] == 200_000_000 and counted["qdisc"][0] == "tbf", counted
    assert counted["bytes"] >= (reps + 1) * ring, counted  # the warm-up's too
    bound = reps * ring / shape.bytes_per_second  # seconds the shaped link needs at the least
    for r in range(n):
        took = json.loads((tmp_path / f"rank_{r}" / "link.json").read_text())["seconds"]
        assert took >= 0.9 * bound, f"rank {r}: {reps} all-reduces of {mib} MiB took {took:.2f}s, below the " \
                                    f"{bound:.2f}s the link's rate allows: the link was not shaped"

"""mindzero.launch's mapping of launcher variables onto MindSpore's, and local_launch's reading of
launcher reports (which rank failed first): pure logic, no MindSpore, no processes."""
import pytest

from mindzero.launch.mpi import cluster_env, job_port, launcher_rank
from mindzero.launch.logs import describe_signal, fault_location, fault_phase, first_failure


def test_openmpi_pmi_and_slurm_variables():
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                          "OMPI_MCA_ess_base_jobid": "77"}) == ("OpenMPI", 3, 4, "77")
    assert launcher_rank({"PMI_RANK": "1", "PMI_SIZE": "2"}) == ("PMI", 1, 2, "")
    assert launcher_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "5"}) == ("Slurm", 0, 8, "5")


@pytest.mark.parametrize("env,match", [
    ({}, "no launcher rank variables found"),
    ({"PMI_RANK": "2", "PMI_SIZE": "2"}, r"PMI_RANK=2 with PMI_SIZE=2: the rank must lie in \[0, size\)"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "rank and size must be integers"),
])
def test_bad_launcher_variables(env, match):
    with pytest.raises(RuntimeError, match=match):
        launcher_rank(env)


def test_cluster_env():
    env = cluster_env(1, 4, "job", env={})
    assert env["MS_ROLE"] == "MS_WORKER" and env["MS_WORKER_NUM"] == "4"
    assert env["MS_NODE_ID"] == env["RANK_ID"] == "1"
    assert env["MS_SCHED_HOST"] == "127.0.0.1" and env["MS_SCHED_PORT"] == str(job_port("job"))
    given = cluster_env(0, 2, "job", env={"MS_SCHED_HOST": "node0", "MS_SCHED_PORT": "8118"})
    assert (given["MS_SCHED_HOST"], given["MS_SCHED_PORT"]) == ("node0", "8118")
    assert cluster_env(0, 2, "job", "h", 9000, env={"MS_SCHED_PORT": "8118"})["MS_SCHED_PORT"] == "9000"
    with pytest.raises(ValueError, match="master_port=70000"):
        cluster_env(0, 2, "job", master_port=70000, env={})


def test_job_port_is_shared_and_in_range():
    assert job_port("a") == job_port("a")
    # below Linux's ephemeral ports (32768 up): no outgoing connection of this host can hold a derived port
    assert all(20000 <= job_port(str(i)) < 32768 for i in range(200))
    assert len({job_port(str(i)) for i in range(200)}) > 150


def _held(kind):
    """A loopback port held by ``kind``: a listening socket (another server, or a scheduler of another job), or a
    connected client socket bound to it (as an outgoing connection holds its local port). Returns the sockets and
    the port."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    if kind == "listener":
        return [server], server.getsockname()[1]
    client = socket.socket()
    client.bind(("127.0.0.1", 0))
    client.connect(server.getsockname())
    accepted, _ = server.accept()
    return [server, client, accepted], client.getsockname()[1]


@pytest.mark.parametrize("kind", ["listener", "client"])
@pytest.mark.parametrize("given, where", [(True, "given"), (False, "derived from the job id")])
def test_a_port_in_use_is_refused_naming_it(kind, given, where):
    """MindSpore's scheduler cannot bind a port something else holds, and its workers then retry for half an hour
    (measured with each of these holders): rank 0 refuses the port first, naming it and the way out."""
    from mindzero.launch.local import free_port
    from mindzero.launch.mpi import check_port_free

    socks, port = _held(kind)
    try:
        with pytest.raises(RuntimeError, match=rf"MS_SCHED_PORT={port} \({where}\): 127.0.0.1:{port} is already "
                                               r"in use on this host.*--master-port P"):
            check_port_free("127.0.0.1", port, given)
    finally:
        for s in socks:
            s.close()
    check_port_free("127.0.0.1", free_port(), given)  # a free port passes
    check_port_free("192.0.2.1", free_port(), given)  # not this host's address: left to the scheduler to report


def test_a_scheduler_that_exited_is_reported_with_its_log(tmp_path):
    from mindzero.launch.mpi import scheduler_failed

    class Proc:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    log = tmp_path / "scheduler.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)) + "RuntimeError: Failed to initialize cluster\n")
    scheduler_failed(Proc(None), log, "127.0.0.1", 1234)  # still running: nothing to say
    with pytest.raises(RuntimeError, match=r"scheduler for 127.0.0.1:1234 exited with code 1 before the job "
                                           r"started") as err:
        scheduler_failed(Proc(1), log, "127.0.0.1", 1234)
    assert "Failed to initialize cluster" in str(err.value) and "line 39" in str(err.value)
    assert "line 10\n" not in str(err.value)  # the end of the log, not all of it
    with pytest.raises(RuntimeError, match=r"\(no log\)"):
        scheduler_failed(Proc(1), tmp_path / "missing.log", "127.0.0.1", 1234)


def test_rank0_refuses_a_held_port_before_it_starts_a_scheduler(monkeypatch, tmp_path):
    import mindzero.launch.mpi as launch

    started = []
    socks, port = _held("listener")
    monkeypatch.setattr(launch, "launcher_rank", lambda: ("OpenMPI", 0, 2, "7"))
    monkeypatch.setattr(launch, "start_scheduler", lambda env, log: started.append(env))
    monkeypatch.setattr(launch, "run_script", lambda *a: started.append("script"))
    monkeypatch.delenv("MS_ROLE", raising=False)
    monkeypatch.setattr(launch.os, "environ", dict(launch.os.environ))
    try:
        with pytest.raises(RuntimeError, match=rf"MS_SCHED_PORT={port} \(given\)"):
            launch.main(["--log-dir", str(tmp_path), "--master-port", str(port), "script.py"])
    finally:
        for s in socks:
            s.close()
    assert started == []


def test_first_failure_picks_the_earliest_msrun_report():
    out = ("[ERROR] ME(1:2,MainProcess):2026-11-21-10:16:45.802.000 [x.py:365] Worker process 40 exit with "
           "exception. Error code: -15.\n"
           "[ERROR] ME(3:4,MainProcess):2026-11-21-10:16:17.825.000 [x.py:365] Worker process 41 exit with "
           "exception. Error code: -9.\n")
    assert first_failure(out, {40: 0, 41: 3}) == (3, "killed by signal 9 (SIGKILL: sent by the kernel's "
                                                     "out-of-memory killer when memory runs out, or by a user)")
    assert first_failure(out.replace("-9.", "1."), {40: 0, 41: 3}) == (3, "exit status 1")
    assert first_failure(out, {}) is None  # unknown pids: the caller falls back to the logs


def test_first_failure_reads_mpirun_reports():
    assert first_failure("mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 11 "
                         "(Segmentation fault).", {}) == (1, "killed by signal 11 (SIGSEGV: a crash in native code)")
    text = "The first process to do so was:\n\n  Process name: [[32749,1],1]\n  Exit code:    1\n"
    assert first_failure(text, {}) == (1, "exit status 1")


@pytest.mark.parametrize("ending, killed", [(SystemExit(None), False), (SystemExit(0), False), (SystemExit(2), True),
                                            (ValueError("boom"), True)])
def test_rank0_keeps_the_scheduler_when_the_script_exits_cleanly(monkeypatch, tmp_path, ending, killed):
    """A script ending in ``sys.exit(main())`` succeeded: rank 0 must not kill MindSpore's scheduler then
    (the other ranks still unregister from it; found as an mpirun job aborted with "Failed to unregister
    from the meta server node"); on a failure it kills it so nobody waits. No processes: the scheduler is
    a stand-in."""
    import mindzero.launch.mpi as launch

    class Scheduler:
        kills = 0

        def kill(self):
            Scheduler.kills += 1

        def poll(self):
            return None  # running

        def wait(self, timeout):
            return 0

    def script(*_):
        raise ending

    monkeypatch.setattr(launch, "launcher_rank", lambda: ("OpenMPI", 0, 2, "7"))
    monkeypatch.setattr(launch, "start_scheduler", lambda env, log: Scheduler())
    monkeypatch.setattr(launch, "wait_for_scheduler", lambda *a: None)
    monkeypatch.setattr(launch, "run_script", script)
    monkeypatch.setattr(launch.atexit, "register", lambda *a: None)
    monkeypatch.delenv("MS_ROLE", raising=False)
    monkeypatch.setattr(launch.os, "environ", dict(launch.os.environ))  # cluster_env's variables stay here
    with pytest.raises(type(ending)):
        launch.main(["--log-dir", str(tmp_path), "script.py"])
    assert Scheduler.kills == int(killed)


def test_rank0_runs_its_script_once_the_scheduler_listens():
    """Rank 0 starts MindSpore's scheduler and waits until its port accepts connections (a worker registering
    before that kept failing for 10-15 s); it stops waiting when the scheduler has exited."""
    import socket
    import threading
    import time

    from mindzero.launch.local import free_port
    from mindzero.launch.mpi import wait_for_scheduler

    class Running:
        def poll(self):
            return None

    class Exited:
        def poll(self):
            return 1

    port = free_port()
    server = socket.socket()
    opened = []

    def listen_later():
        time.sleep(0.5)
        server.bind(("127.0.0.1", port))
        server.listen()
        opened.append(time.monotonic())

    thread = threading.Thread(target=listen_later)
    start = time.monotonic()
    thread.start()
    try:
        wait_for_scheduler(Running(), "127.0.0.1", port, timeout=20)
        returned = time.monotonic()
    finally:
        thread.join()
        server.close()
    assert opened and opened[0] <= returned < start + 10, (start, opened, returned)
    start = time.monotonic()
    wait_for_scheduler(Exited(), "127.0.0.1", free_port(), timeout=20)
    assert time.monotonic() - start < 1


FAULT = """[INFO] DISTRIBUTED(1,2,python):2026-11-27 ... Start] Event base dispatch success!
Fatal Python error: Segmentation fault

Current thread 0x00007f5e6f3deb80 (most recent call first):
  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at
  File "/repo/tests/multirank/worker_fail.py", line 30 in crash
  File "/repo/tests/multirank/worker_fail.py", line 35 in first_step
  File "/repo/tests/multirank/worker_fail.py", line 40 in <module>

Extension modules: numpy.core._multiarray_umath, mindspore._c_expression (total: 2)
"""


def test_a_crashed_ranks_place_is_read_from_its_faulthandler_stack():
    assert fault_location(FAULT) == ("Segmentation fault in string_at (__init__.py:519) <- crash (worker_fail.py:30) "
                                     "<- first_step (worker_fail.py:35) <- <module> (worker_fail.py:40)")
    assert fault_location(FAULT, frames=2) == \
        "Segmentation fault in string_at (__init__.py:519) <- crash (worker_fail.py:30)"
    assert fault_location("Traceback (most recent call last):\n  File \"x.py\", line 1 in f\n") == ""  # no fault
    assert describe_signal(15) == "signal 15 (SIGTERM: asked to stop (by a launcher or a user))"
    assert describe_signal(10) == "signal 10 (SIGUSR1)" and describe_signal(99) == "signal 99"


def _stack(*frames):
    """A faulthandler report of a segfault in ``frames`` ((path, function), innermost first)."""
    lines = "\n".join(f'  File "{path}", line 7 in {func}' for path, func in frames)
    return f"Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n{lines}\n\n"


SITE = "/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize("frames, phase", [
    ([(f"{SITE}/mindspore/nn/cell.py", "compile"), ("/src/mindzero/engine/train_step.py", "compile"),
      ("/src/mindzero/engine/train_step.py", "__call__"), ("/job/train.py", "main")],
     "compiling the train step's graph"),
    ([(f"{SITE}/mindspore/nn/cell.py", "__call__"), (f"{SITE}/mindzero/engine/train_step.py", "__call__")],
     "running a train step"),
    ([(f"{SITE}/mindspore/communication/management.py", "init"), ("/job/train.py", "<module>")],
     "joining the cluster (mindspore.communication.init)"),
    ([(f"{SITE}/mindspore/nn/cell.py", "__call__"), ("/src/mindzero/engine/offload.py", "update"),
      ("/src/mindzero/engine/offload.py", "after_step"), ("/src/mindzero/engine/train_step.py", "__call__")],
     "the streamed optimizer update (optimizer_offload='disk')"),
    ([("/src/mindzero/checkpoint/tensor_io.py", "write"), ("/src/mindzero/checkpoint/save.py", "save_checkpoint")],
     "saving a checkpoint"),
    ([("/src/mindzero/engine/assemble.py", "build_state"), ("/src/mindzero/engine/prepare.py",
                                                           "prepare_train_network")],
     "prepare_train_network (sharding the model)"),
    ([(f"{SITE}/mindspore/common/tensor.py", "asnumpy"), ("/job/train.py", "main")],
     "inside MindSpore (asnumpy (tensor.py)), outside the phases mindzero names"),
    ([("/src/mindzero/comm/groups.py", "rehearse")], "inside mindzero, outside the phases it names"),
    ([("/usr/lib/python3.11/ctypes/__init__.py", "string_at"), ("/job/train.py", "first_step")],
     "the script's own code (no mindzero or MindSpore frame on the stack)"),
    # under mpirun every script runs inside mindzero.launch: its frames are not the script's phase
    ([("/usr/lib/python3.11/ctypes/__init__.py", "string_at"), ("/job/train.py", "first_step"),
      ("<frozen runpy>", "run_path"), (f"{SITE}/mindzero/launch/mpi.py", "run_script"),
      (f"{SITE}/mindzero/launch/mpi.py", "main")],
     "the script's own code (no mindzero or MindSpore frame on the stack)"),
])
def test_the_phase_a_rank_died_in_is_the_innermost_known_frame(frames, phase):
    assert fault_phase(_stack(*frames)) == phase


def test_no_stack_no_phase():
    assert fault_phase("Traceback (most recent call last):\n  File \"x.py\", line 1 in f\n") == ""
    assert fault_phase(FAULT) == "the script's own code (no mindzero or MindSpore frame on the stack)"


def test_the_reader_names_the_failed_rank_of_a_saved_mpirun_output(tmp_path, capsys):
    """``python -m mindzero.launch.logs JOB.log``: what a user's ``mpirun ... | tee JOB.log`` saved -> the rank, the
    signal, where its Python was and the phase; a file without a failure says so and exits 1."""
    from mindzero.launch.logs import main

    job = tmp_path / "job.log"
    job.write_text("rank 0 training\n" + _stack(("/usr/lib/python3.11/ctypes/__init__.py", "string_at"),
                                                 (f"{SITE}/mindspore/nn/cell.py", "compile"),
                                                 ("/src/mindzero/engine/train_step.py", "compile"),
                                                 ("/src/mindzero/launch/mpi.py", "run_script"))
                   + "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 11 (Segmentation "
                     "fault).\n")
    assert main([str(job)]) == 0
    assert capsys.readouterr().out == (
        "rank 1 failed first (killed by signal 11 (SIGSEGV: a crash in native code); Segmentation fault in string_at "
        "(__init__.py:7) <- compile (cell.py:7) <- compile (train_step.py:7) <- run_script (mpi.py:7); phase: "
        "compiling the train step's graph)\n")
    msrun = tmp_path / "msrun.log"  # msrun --join: the workers' lines name their pids' ranks, msrun names the pid
    msrun.write_text(
        "[WARNING] DISTRIBUTED(20698,7f8c,python):2026-11-29-15:49:45.848.054 [cluster_context.cc:428] PostProcess] "
        "This node 1 rank id: 1\n"
        "[WARNING] DISTRIBUTED(20696,7fd7,python):2026-11-29-15:49:48.679.861 [cluster_context.cc:428] PostProcess] "
        "This node 0 rank id: 0\n"
        + _stack(("/usr/lib/python3.11/ctypes/__init__.py", "string_at"), ("/job/train.py", "first_step"))
        + "[ERROR] ME(20690:1398,MainProcess):2026-11-29-15:49:49.174.000 [_api.py:365] Worker process 20698 exit "
          "with exception. Error code: -11.\n")
    assert main([str(msrun)]) == 0
    assert capsys.readouterr().out.startswith("rank 1 failed first (killed by signal 11 (SIGSEGV: a crash in native "
                                              "code); Segmentation fault in string_at (__init__.py:7) <- first_step")
    worker = tmp_path / "worker_1.log"  # msrun's log of one rank: its stack, no launcher report
    worker.write_text(_stack(("/usr/lib/python3.11/ctypes/__init__.py", "string_at"),
                             (f"{SITE}/mindspore/communication/management.py", "init")))
    assert main([str(worker)]) == 0
    assert capsys.readouterr().out == (f"{worker}: Segmentation fault in string_at (__init__.py:7) <- init "
                                       "(management.py:7); phase: joining the cluster "
                                       "(mindspore.communication.init)\n")
    job.write_text("rank 0 training\nrank 1 training\n")
    assert main([str(job)]) == 1
    assert "no rank that failed" in capsys.readouterr().out

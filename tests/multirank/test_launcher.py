"""The launcher never waits forever, and a failing rank fails the launch with that rank's log."""
import time

import pytest

from mindzero.launch.local import LaunchError, free_port, msrun

from . import WORKERS


def test_free_ports_differ():
    assert len({free_port() for _ in range(5)}) >= 4


def test_failing_rank_shows_its_log(tmp_path, monkeypatch):
    """Also with the output directory given relative to the working directory (the ranks run inside it: a
    relative path given on to them would nest, and the rank's log would not be found)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError) as err:
        # the survivor waits in a collective until MindSpore's scheduler declares the raised rank dead
        # (MS_NODE_TIMEOUT, default 30 s): 10 s keeps the test short
        msrun(WORKERS / "worker_fail.py", 2, "failing", ["--mode", "raise"], timeout=300, env={"MS_NODE_TIMEOUT": "10"})
    text = str(err.value)
    assert "rank 1 failed first (exit status 1)" in text and "log tail of rank 1" in text, text
    assert "deliberate failure on rank 1" in text, text
    assert (tmp_path / "failing" / "logs").is_dir() and not (tmp_path / "failing" / "failing").exists()


def test_hanging_rank_is_killed_at_the_timeout(tmp_path):
    import psutil

    start = time.time()
    with pytest.raises(LaunchError, match=r"timed out after 30s; ranks without results: \[0, 1\]"):
        msrun(WORKERS / "worker_fail.py", 2, tmp_path, ["--mode", "hang"], timeout=30)
    assert time.time() - start < 90
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left == [], f"processes left behind: {left}"

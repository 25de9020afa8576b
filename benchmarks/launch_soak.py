"""Many launches of a training run, to catch a rank that dies on the way to its first steps or after.

    .venv/bin/python benchmarks/launch_soak.py [--launches 30] [--launchers msrun,mpirun] [--stages 1,2,3]
        [--steps 20] [--cold] [--fresh] [--out runs/launch_soak]

Each launch trains examples/train_gpt.py (its stage-2 config's GPT, ``--stage`` cycling over ``--stages``,
``--steps`` steps, from nothing) on 2 ranks, with ``mindzero.launch.local`` (``msrun``, or ``mpirun -n 2 python
-m mindzero.launch``), Python's ``faulthandler`` on in every rank (the launcher sets ``PYTHONFAULTHANDLER``) and
core dumps allowed (``RLIMIT_CORE`` unlimited; a core lands in the launch's directory with this machine's
``core_pattern`` of ``core``). The launchers alternate, so a slow or busy minute of the machine touches both.
``mpirun-user`` launches as the docs tell users to: ``mpirun -n 2 python -m mindzero.launch SCRIPT ARGS``, no port
given (the ranks derive it from the job id), the ranks' output through mpirun's.

``--cold``: before each launch, evict from the page cache every file of the Python installation, the environment's
packages (MindSpore's libraries among them), mindzero and the examples (``posix_fadvise(POSIX_FADV_DONTNEED)``;
needs no privilege, unlike ``/proc/sys/vm/drop_caches``), so that every launch starts as the first of a day does.
``--fresh``: before each launch, also remove what a new machine has not built before its first launch (matplotlib's
font cache, the bytecode of mindzero and the examples). ``--steps 0``: the config's whole run (800 steps, a checkpoint
every 200 and the older ones removed, then rank 0's merge, sample and plot).

Per launch: the launcher, the stage, seconds, and for a failed one the launcher's report (the rank that failed
first, how: a signal with the Python stack ``faulthandler`` printed, an exception, a timeout) and any core file.
Writes ``results.json`` and ``results.md`` under ``--out``; failed launches keep their directory, passed ones
are removed (``--keep`` keeps all).
"""
import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.launch.local import LaunchError, kill_tree, launch  # noqa: E402

SCRIPT = ROOT / "examples" / "train_gpt.py"
CONFIG = ROOT / "examples" / "configs" / "gpt_stage2.yaml"


def evict(roots) -> tuple:
    """Drop the page cache of every regular file under ``roots``; ``(files, bytes)`` dropped."""
    files = size = 0
    for root in roots:
        for path in Path(root).rglob("*"):
            try:
                if not path.is_file() or path.is_symlink():
                    continue
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                files, size = files + 1, size + os.fstat(fd).st_size
            finally:
                os.close(fd)
    return files, size


def cold_roots() -> list:
    """Where a launch reads its code from: the Python installation, the environment's packages, mindzero, the
    examples."""
    import site
    import sysconfig

    return sorted({sysconfig.get_paths()["stdlib"], *site.getsitepackages(), str(ROOT / "mindzero"),
                   str(ROOT / "examples")})


def matplotlib_dirs() -> list:
    """Where matplotlib keeps its configuration and its caches (the font list), found as matplotlib finds them
    (``MPLCONFIGDIR``, else the XDG directories or their defaults under the home directory), without importing it
    (which would build them)."""
    if os.environ.get("MPLCONFIGDIR"):
        return [Path(os.environ["MPLCONFIGDIR"])]
    home = Path.home()
    return [Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "matplotlib",
            Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "matplotlib"]


def freshen() -> list:
    """Remove what a new machine's first launch does not find yet: matplotlib's caches (its font list, which the
    example's rank 0 builds when it plots; rebuilt by the next import) and the compiled bytecode of mindzero and the
    examples (which both ranks then write at once, unless ``PYTHONDONTWRITEBYTECODE`` is set). The paths
    removed."""
    gone = [p for p in matplotlib_dirs() if p.exists()]
    gone += [p for top in ("mindzero", "examples") for p in (ROOT / top).rglob("__pycache__")]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def as_user(run_dir: Path, args, timeout: float) -> None:
    """``mpirun -n 2 python -m mindzero.launch SCRIPT ARGS`` as the docs give it to users: no port (each rank
    derives it from the job id), the ranks' output through mpirun's own (no per-rank files), ``faulthandler`` on.
    Raises ``LaunchError`` with mpirun's report and the end of its output unless it ended well and every rank
    wrote its marker."""
    import subprocess

    from mindzero.launch.logs import first_failure, with_fault

    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MS_SCHED_PORT"}
    env.update(PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    root = ["--allow-run-as-root", "--oversubscribe"] if os.geteuid() == 0 else ["--oversubscribe"]
    log = run_dir / "mpirun.log"
    with open(log, "w") as f:
        job = subprocess.Popen(["mpirun", *root, "-n", "2", sys.executable, "-m", "mindzero.launch", "--log-dir",
                                str(run_dir), str(SCRIPT), *args], env=env, cwd=run_dir, stdout=f,
                               stderr=subprocess.STDOUT)
        try:
            code = job.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(job.pid)  # mpirun and every rank it started
            code = f"timed out after {timeout:.0f}s"
    text = log.read_text(errors="replace")
    done = all((run_dir / f"rank_{r}.done").exists() for r in range(2))
    if code != 0 or not done:
        failed = first_failure(text, {})
        how = "rank {} failed first ({})".format(*with_fault(failed, text)) if failed else f"mpirun ended: {code}"
        raise LaunchError(f"{how}; markers written: {done}\n--- end of {log}:\n" + "\n".join(text.splitlines()[-30:]))


def one(i: int, launcher: str, stage: int, out: Path, a) -> dict:
    run_dir = out / f"launch_{i:03d}_{launcher}_s{stage}"
    if a.cold:
        files, size = evict(cold_roots())
        print(f"launch {i}: evicted {files} files ({size / 2 ** 30:.2f} GiB) from the page cache", flush=True)
    if a.fresh:
        print(f"launch {i}: removed {len(freshen())} caches a new machine has not built yet", flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = ["--steps", str(a.steps)] if a.steps else []  # 0: the config's own run, its checkpoints on the way
    # --out: the launcher waits for the markers the script writes there
    args = ["--config", str(CONFIG), "--stage", str(stage), *steps, "--no-resume", "--out", str(run_dir)]
    t = time.time()
    row = dict(launch=i, launcher=launcher, stage=stage, ok=True, report="")
    try:
        if launcher == "mpirun-user":
            as_user(run_dir, args, a.timeout)
        else:
            launch(SCRIPT, 2, run_dir, args, timeout=a.timeout, launcher=launcher)
    except LaunchError as err:
        row.update(ok=False, report=str(err).split("\n--- ")[0])
        row["cores"] = [str(p) for p in run_dir.rglob("core*") if p.is_file()]
    row["seconds"] = round(time.time() - t, 1)
    print(f"launch {i}: {launcher} stage {stage}: {'ok' if row['ok'] else 'FAILED: ' + row['report'][:300]} "
          f"({row['seconds']}s)", flush=True)
    if row["ok"] and not a.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def markdown(rows) -> str:
    lines = ["| launcher | launches | failed | seconds (median) |", "|---|---|---|---|"]
    for launcher in sorted({r["launcher"] for r in rows}):
        mine = [r for r in rows if r["launcher"] == launcher]
        secs = sorted(r["seconds"] for r in mine)
        lines.append(f"| {launcher} | {len(mine)} | {sum(not r['ok'] for r in mine)} | {secs[len(secs) // 2]} |")
    failed = [r for r in rows if not r["ok"]]
    if failed:
        lines += ["", "Failed launches:", ""]
        lines += [f"- launch {r['launch']} ({r['launcher']}, stage {r['stage']}): {r['report']}"
                  + (f"; cores: {r['cores']}" if r.get("cores") else "") for r in failed]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=30, help="launches per launcher")
    ap.add_argument("--launchers", default="msrun,mpirun",
                    help="among msrun, mpirun (a free port passed, per-rank logs) and mpirun-user (the command line "
                         "the docs give: no port, the ranks' output through mpirun's)")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--steps", type=int, default=20, help="steps per launch; 0: the config's own (800, a checkpoint "
                                                           "every 200)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--cold", action="store_true", help="evict the code's files from the page cache before each "
                                                         "launch (the first launch of a day)")
    ap.add_argument("--fresh", action="store_true", help="remove matplotlib's caches and the code's bytecode before "
                                                          "each launch (what a new machine has not built yet)")
    ap.add_argument("--keep", action="store_true", help="keep the directories of launches that passed")
    ap.add_argument("--out", default="runs/launch_soak")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):  # not allowed to raise the hard limit: as far as it goes
        hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    launchers, stages = a.launchers.split(","), [int(s) for s in a.stages.split(",")]
    rows = []
    for k in range(a.launches):
        for j, launcher in enumerate(launchers):
            i = k * len(launchers) + j
            rows.append(one(i, launcher, stages[k % len(stages)], out, a))
            (out / "results.json").write_text(json.dumps(rows, indent=1))  # a stopped soak keeps what it saw
    text = markdown(rows)
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

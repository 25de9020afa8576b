"""What a bug report needs: ``python -m mindzero.env`` (or ``mindzero-env``).

    mindzero-env                         # this machine: versions, devices, how each collective would run
    mindzero-env --ranks 2               # also N local ranks launched with msrun: the world, every collective run
                                         # and checked against NumPy, a small network trained at every stage
    mindzero-env --ranks 8 --device Ascend --json

It prints mindzero's version and commit, MindSpore's version (and whether mindzero was tested on it), the device
MindSpore runs on and the devices it can see, Python, NumPy, mindone and mindcv, the environment variables of a
launch, and per collective operation of a train step what carries it on this device: MindSpore's own primitive
(``real``) or a CPU emulation with the same result (``emulated``). With ``--ranks N`` each rank also runs every
collective once and trains a two-layer network at stages 0-3 (and stage 3 with int8 gathers) from the same start,
reporting each stage's largest difference from stage 0.

Started by a launcher of your own, as each rank's script (``msrun ... $(python -c "import mindzero.env as e;
print(e.__file__)")``), every rank writes its report, checks included, into its own log.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a launcher's script: the package's own folders must not shadow top-level modules

import argparse
import contextlib
import json
import os
import platform
import subprocess
import tempfile
import time

from mindzero.core.topology import DEVICES, collective_routes, backend_for, requested_device
from mindzero.core.versions import TESTED_MINDSPORE, installed_versions, support

#: environment variables a launch is described by (besides every MINDZERO_* one)
LAUNCH_VARIABLES = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID", "RANK_ID", "RANK_SIZE",
                    "DEVICE_ID", "RANK_TABLE_FILE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                    "PMI_SIZE", "MS_NODE_TIMEOUT")


def git_commit(path: Path):
    """``(commit, changed)`` of the git checkout holding ``path``, or ``None`` outside one (an installed wheel)."""
    try:
        top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10)
        if top.returncode or not (Path(top.stdout.strip()) / "mindzero" / "__init__.py").exists():
            return None
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return None


def software() -> dict:
    """Versions and locations: mindzero (and its commit), MindSpore (and how mindzero stands to it), Python and the
    packages a report names."""
    import mindzero

    here = Path(mindzero.__file__).resolve().parent
    versions = installed_versions()
    commit = git_commit(here)
    ms_version = versions.get("mindspore")
    return {"mindzero": {"version": mindzero.__version__, "path": str(here),
                         "commit": None if commit is None else commit[0] + ("+changes" if commit[1] else "")},
            "mindspore": {"version": ms_version, "support": support(ms_version) if ms_version else None,
                          "tested": list(TESTED_MINDSPORE)},
            "python": f"{platform.python_version()} ({sys.executable})",
            "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
            "packages": {k: v for k, v in versions.items() if k not in ("mindzero", "mindspore")}}


@contextlib.contextmanager
def _quiet_stderr():
    """MindSpore's C++ prints a line per device library it cannot load; a report keeps its own output clean."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def devices() -> dict:
    """The device MindSpore runs on (``device_target``: what the script or MindSpore chose), the one mindzero
    would set (``requested``: ``MINDZERO_DEVICE``; ``None`` leaves MindSpore's), and which devices this MindSpore
    can drive here, with their count."""
    import mindspore as ms

    available = {}
    with _quiet_stderr():
        for d in DEVICES:
            try:
                ok = bool(ms.hal.is_available(d))
                available[d] = ms.hal.device_count(d) if ok and d != "CPU" else int(ok)
            except Exception as err:  # an older MindSpore without hal, or a device library that fails to load
                available[d] = f"unknown ({type(err).__name__})"
        target = ms.get_context("device_target")
    try:
        requested = requested_device(None, os.environ)
    except ValueError as err:
        requested = f"invalid: {err}"
    return {"device_target": target, "requested": requested, "available": available}


def variables() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MINDZERO_") or k in LAUNCH_VARIABLES}


def machine_report() -> dict:
    """Everything that needs no launch; the collectives as a world of several ranks on this device would run them."""
    dev = devices()
    device = dev["requested"] if dev["requested"] in DEVICES else dev["device_target"]
    backend = backend_for(device, 2)
    return {"software": software(), "devices": dev, "variables": variables(),
            "collectives": {"device": device, "backend": backend,
                            "routes": [r.__dict__ for r in collective_routes(backend)]}}


# --- inside a launch --------------------------------------------------------------------------------------------
def check_collectives(world) -> dict:
    """Each collective of :func:`~mindzero.core.topology.collective_routes` that runs alone, once, on this world:
    ``{operation: {"ok": bool, "seconds": float, "error": str}}``, every result compared with NumPy's."""
    import numpy as np
    from mindspore import Tensor

    from mindzero.comm import AllGather, AllReduceSum, ReduceScatterSum, backend_of

    n, r = world.world_size, world.world_rank
    numel = 3 * n + 1  # padding exercised
    padding = -numel % n
    x = np.arange(numel, dtype=np.float32) + 1
    total = np.concatenate([x * sum(range(1, n + 1)), np.zeros(padding, np.float32)])
    shard = (numel + padding) // n
    cases = {
        "all-gather": (lambda: AllGather(world, "world")(Tensor(np.full(2, r, np.float32))).asnumpy(),
                       np.repeat(np.arange(n, dtype=np.float32), 2)),
        "all-reduce": (lambda: AllReduceSum(world)(Tensor(x * (r + 1))).asnumpy(), x * sum(range(1, n + 1))),
        "reduce-scatter": (lambda: ReduceScatterSum(world)(Tensor(x * (r + 1)), padding).asnumpy(),
                           total[world.op_rank * shard:(world.op_rank + 1) * shard]),
        "broadcast": (lambda: backend_of(world).host_broadcast(n - 1)(Tensor(x * (r + 1))), x * n),
    }
    out = {}
    for name, (run, expected) in cases.items():
        t = time.perf_counter()
        try:
            got = run()
            ok = bool(np.array_equal(got, expected))
            out[name] = {"ok": ok, "error": "" if ok else f"got {got[:6]}..., expected {expected[:6]}..."}
        except Exception as err:  # reported, not raised: the report is what the user needs
            out[name] = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        out[name]["seconds"] = round(time.perf_counter() - t, 3)
    return out


#: the training check's configurations: (name, stage, settings, what is compared with stage 0 and its bound): the
#: exact stages their final parameters (bit for bit on CPU), int8 gathers the first step's loss (their rounding)
TRAINED = (("stage 0", 0, {}, "parameters", 1e-5), ("stage 1", 1, {}, "parameters", 1e-5),
           ("stage 2", 2, {}, "parameters", 1e-5), ("stage 3", 3, {}, "parameters", 1e-5),
           ("stage 3, int8 gathers", 3, {"gather_quantization": {"kind": "int8", "block_size": 16, "min_numel": 0}},
            "first loss", 1e-2))


def _rel_diff(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def check_training(world, steps: int = 2) -> dict:
    """A two-layer network of odd shapes trained ``steps`` steps at each of :data:`TRAINED` from the same start on the
    same data (every parameter sharded): ``{name: {"ok", "compared", "max_rel_diff", "seconds", "error"}}``, the
    largest relative difference from stage 0 of what the row compares."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    import mindzero

    rng = np.random.RandomState(world.world_rank)
    data = [(Tensor(rng.randn(4, 7).astype(np.float32)), Tensor(rng.randn(4, 3).astype(np.float32)))
            for _ in range(steps)]
    out, reference = {}, None
    for name, stage, settings, compared, bound in TRAINED:
        t = time.perf_counter()
        try:
            ms.set_seed(0)
            loss_net = nn.WithLossCell(nn.SequentialCell(nn.Dense(7, 15), nn.ReLU(), nn.Dense(15, 3)), nn.MSELoss())
            opt = nn.AdamWeightDecay(loss_net.trainable_params(), 1e-2)
            train = mindzero.prepare_train_network(loss_net, opt, zero_stage=stage,
                                                   stage3_param_persistence_threshold=0, **settings)
            losses = [float(train(x, y)[0].asnumpy()) for x, y in data]
            run = {"parameters": mindzero.gather_full_state_dict(train), "first loss": {"loss": losses[0]}}
            reference = reference or run
            diff = max(_rel_diff(v, reference[compared][k]) for k, v in run[compared].items())
            out[name] = {"ok": diff <= bound, "compared": compared, "max_rel_diff": diff,
                         "error": "" if diff <= bound else f"{compared} differ from stage 0's by {diff:.2e}, above "
                                                           f"{bound:g}"}
        except Exception as err:
            out[name] = {"ok": False, "compared": compared, "max_rel_diff": None,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        out[name]["seconds"] = round(time.perf_counter() - t, 3)
    return out


def rank_report(world, check: bool = True) -> dict:
    """This rank's world and groups, its device and backend, and (``check``) its collectives and training checks."""
    import mindspore as ms

    mode = {ms.GRAPH_MODE: "graph", ms.PYNATIVE_MODE: "pynative"}.get(ms.get_context("mode"), "?")
    report = {"world_rank": world.world_rank, "world_size": world.world_size, "device": world.device, "mode": mode,
              "backend": world.backend, "world_group": world.world_group,
              "op_group": {"name": world.op_group, "ranks": list(world.op_ranks)},
              "dp_group": {"name": world.dp_group, "ranks": list(world.dp.ranks)},
              "routes": [r.__dict__ for r in world.routes()]}
    if check:
        report["collective_checks"] = check_collectives(world)
        report["training_checks"] = check_training(world)
    return report


def launched() -> bool:
    """Whether this process is part of a launch: a rank (msrun's workers and ``python -m mindzero.launch``'s ranks
    under mpirun carry ``MS_ROLE=MS_WORKER``) or the scheduler msrun starts with the same script (``MS_SCHED``,
    whose ``init()`` serves the cluster)."""
    return os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED")


def launch_check(ranks: int, timeout: float) -> dict:
    """``ranks`` local ranks launched with msrun, each running :func:`rank_report` with its checks: ``{"ranks":
    [every rank's report]}``, or ``{"error": the launch's failure}``."""
    from mindzero.launch.local import LaunchError, launch

    out = Path(tempfile.mkdtemp(prefix="mindzero_env_"))
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the launcher's own line: stdout is the report
            launch(Path(__file__).resolve(), ranks, out, ["--rank-report"], timeout, launcher="msrun")
    except (LaunchError, OSError, ValueError) as err:
        return {"error": str(err), "logs": str(out / "logs")}
    reports = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(ranks)]
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    return {"ranks": reports}


def _checks_text(rows: list, key: str) -> list:
    """One line per check of ``key`` over every rank's report: ok on all, or the ranks that failed and why."""
    lines = []
    for name in rows[0][key]:
        results = [r[key][name] for r in rows]
        bad = [(r["world_rank"], x["error"]) for r, x in zip(rows, results) if not x["ok"]]
        diff, compared = results[0].get("max_rel_diff"), results[0].get("compared")
        shown = "" if diff is None else (f"{compared} bit for bit with stage 0's" if diff == 0 else
                                         f"{compared} within {diff:.1e} of stage 0's")
        seconds = max(x["seconds"] for x in results)
        state = "ok" if not bad else "FAILED on " + "; ".join(f"rank {r}: {e}" for r, e in bad)
        lines.append(f"  {name:<22} {state}{', ' + shown if shown and not bad else ''} ({seconds:.1f} s)")
    return lines


def format_report(report: dict) -> str:
    sw, dev, coll = report["software"], report["devices"], report["collectives"]
    mz, msp = sw["mindzero"], sw["mindspore"]
    standing = {"tested": "tested", "newer": "newer than any tested: untested", "older": "older than supported",
                "between": "inside the tested range, not itself tested", None: "not installed"}[msp["support"]]
    lines = [f"mindzero {mz['version']} ({'commit ' + mz['commit'] if mz['commit'] else 'not a git checkout'}; "
             f"{mz['path']})",
             f"MindSpore {msp['version']}: {standing} (mindzero is tested on {', '.join(msp['tested'])})",
             f"Python {sw['python']}; {sw['platform']}",
             "packages: " + ", ".join(f"{k} {v or '-'}" for k, v in sw["packages"].items()),
             f"device: MindSpore runs on {dev['device_target']}; mindzero sets "
             + (f"{dev['requested']} (MINDZERO_DEVICE)" if dev["requested"] else "none (MINDZERO_DEVICE unset: "
                                                                                 "MindSpore's choice stands)"),
             "devices this MindSpore can drive: " + ", ".join(
                 f"{d} {'no' if not n else n if isinstance(n, str) else 'yes' if d == 'CPU' else f'{n} device(s)'}"
                 for d, n in dev["available"].items()),
             "launch variables: " + (", ".join(f"{k}={v}" for k, v in report["variables"].items()) or "none"),
             f"collectives of a train step on {coll['device']} ({coll['backend']} backend):"]
    lines += [f"  {r['operation']:<15} {r['kind']:<9} {r['runs']}" for r in coll["routes"]]
    world = report.get("world")
    if world is None:
        lines.append("world: not launched (mindzero-env --ranks N launches N local ranks and checks them)")
    elif "error" in world:
        lines.append(f"world: the launch failed (logs in {world['logs']}):\n{world['error']}")
    else:
        rows = world["ranks"]
        lines.append(f"world: {len(rows)} ranks, world group {rows[0]['world_group']!r}")
        lines += [f"  rank {r['world_rank']}: {r['device']}, {r['mode']} mode, {r['backend']} backend, op group {r['op_group']['ranks']}, "
                  f"dp group {r['dp_group']['ranks']}" for r in rows]
        if "collective_checks" in rows[0]:
            lines.append("collectives run once on every rank, compared with NumPy:")
            lines += _checks_text(rows, "collective_checks")
            lines.append("a two-layer network trained 2 steps at each stage from the same start:")
            lines += _checks_text(rows, "training_checks")
    return "\n".join(lines)


def passed(report: dict) -> bool:
    """Whether every check of a report with a world passed (a report without one passes)."""
    world = report.get("world")
    if world is None:
        return True
    if "error" in world:
        return False
    return all(x["ok"] for r in world["ranks"] for key in ("collective_checks", "training_checks")
               for x in r.get(key, {}).values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mindzero-env", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=0, help="also launch this many local ranks (msrun) and check the "
                                                         "world, its collectives and a small training run")
    ap.add_argument("--device", help="CPU, GPU or Ascend for the ranks (default: MINDZERO_DEVICE, else MindSpore's)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-check", action="store_true", help="in a launch: report without running the checks")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds the --ranks launch may take")
    ap.add_argument("--rank-report", action="store_true", help=argparse.SUPPRESS)  # a rank of --ranks' launch
    ap.add_argument("--out", help=argparse.SUPPRESS)  # given by mindzero's launcher to its ranks
    a = ap.parse_args(argv)
    if a.ranks < 0 or (a.ranks == 1):
        ap.error(f"--ranks {a.ranks}: must be 0 (no launch) or at least 2")
    if a.device is not None:
        try:
            os.environ["MINDZERO_DEVICE"] = requested_device(a.device, {})  # for this process and the ranks
        except ValueError as err:
            ap.error(str(err).replace("device=", "--device "))
    if launched():
        from mindzero.comm.start import start_data_parallel
        from mindzero.launch.worker import finish_rank

        world = start_data_parallel()
        mine = rank_report(world, check=not a.no_check)
        if a.rank_report:
            (Path(a.out) / f"rank_{world.world_rank}.json").write_text(json.dumps(mine, indent=1))
            finish_rank(a.out, world.world_rank)
            return 0
        report = dict(machine_report(), world={"ranks": [mine]})
        print(json.dumps(report, indent=1) if a.json else format_report(report), flush=True)
        return 0 if passed(report) else 1
    report = machine_report()
    if a.ranks:
        report["world"] = launch_check(a.ranks, a.timeout)
    print(json.dumps(report, indent=1) if a.json else format_report(report), flush=True)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())

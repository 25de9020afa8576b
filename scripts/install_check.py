"""Installing mindzero leaves the MindSpore already there: build the wheel and the sdist of this checkout, and ask pip,
in the given environment, what installing each would install (``pip install --dry-run --report``). Fails, naming the
artifact and what pip would do, if it would install (or replace) MindSpore or NumPy's major version.

    python scripts/install_check.py [--python .venv/bin/python]

Run by scripts/setup_env.sh after it installs mindzero; prints one line per artifact.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode:
        raise SystemExit(f"install_check: {' '.join(map(str, cmd))} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out


def would_install(python: str, artifact: Path) -> dict:
    """``{name: version}`` pip would install for ``artifact`` in ``python``'s environment (nothing is changed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run([python, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--disable-pip-version-check", "-q",
             "--report", str(report), str(artifact)])
        return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the environment's Python (holding its MindSpore)")
    a = ap.parse_args()
    have = run([a.python, "-c", "from importlib.metadata import version as v; print(v('mindspore'), v('numpy'))"])
    mindspore, numpy = have.stdout.split()
    with tempfile.TemporaryDirectory() as dist:
        run([a.python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, str(ROOT)])
        run([a.python, "setup.py", "-q", "sdist", "-d", dist], cwd=ROOT)
        artifacts = sorted(Path(dist).glob("mindzero-*"))
        if len(artifacts) != 2:
            raise SystemExit(f"install_check: expected a wheel and an sdist, built {[p.name for p in artifacts]}")
        status = 0
        for artifact in artifacts:
            planned = would_install(a.python, artifact)
            changed = {k: v for k, v in planned.items() if k == "mindspore" or (k == "numpy" and v.split(".")[0]
                                                                                  != numpy.split(".")[0])}
            kind = "wheel" if artifact.suffix == ".whl" else "sdist"
            if changed:
                status = 1
                print(f"install_check: installing the {kind} beside MindSpore {mindspore} would install {changed}")
            else:
                print(f"install_check: the {kind} installs {sorted(planned)} beside MindSpore {mindspore}, "
                      "which it leaves in place")
    return status


if __name__ == "__main__":
    sys.exit(main())

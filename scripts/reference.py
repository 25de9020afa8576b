"""docs/reference.md, generated from the code: every public name of ``mindzero`` with its signature and the first
paragraph of its docstring, every command-line tool's ``--help``, and every environment variable mindzero reads.

    python scripts/reference.py            # print the page
    python scripts/reference.py --write    # write docs/reference.md
    python scripts/reference.py --check    # exit 1 if docs/reference.md differs from the code

tests/single/test_reference.py runs ``--check``.
"""
import argparse
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mindzero, whatever is installed
PAGE = ROOT / "docs" / "reference.md"
WIDTH = 116
#: the command-line tools: (the command a user types, how to run it with a fixed program name)
TOOLS = (("mindzero-env", "mindzero.env:main"), ("mindzero-plan", "mindzero.planner.cli:main"),
         ("mindzero-estimate", "mindzero.core.estimate:main"), ("mindzero-merge", "mindzero.checkpoint.cli:main_merge"),
         ("mindzero-reshard", "mindzero.checkpoint.cli:main_reshard"),
         ("mindzero-verify", "mindzero.checkpoint.cli:main_verify"),
         ("python -m mindzero.launch", "mindzero.launch.mpi:main"),
         ("python -m mindzero.launch.local", "mindzero.launch.local:main"),
         ("python -m mindzero.launch.logs", "mindzero.launch.logs:main"))


def first_paragraph(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def signature(name: str, obj) -> str:
    """``name(parameters) -> returns`` wrapped at :data:`WIDTH` on parameter boundaries."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = [re.sub(r" at 0x[0-9a-f]+", "", str(p)) for p in sig.parameters.values()]
    returns = sig.return_annotation
    tail = ")" if returns is inspect.Signature.empty or inspect.isclass(obj) else \
        f") -> {inspect.formatannotation(returns)}"
    lines, line = [], name + "("
    for i, part in enumerate(params):
        piece = part + (", " if i < len(params) - 1 else "")
        if len(line) + len(piece) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = " " * 4
        line += piece
    lines.append(line + tail)
    return "\n".join(lines)


def api_section() -> list:
    import mindzero

    out = ["## The public API (`import mindzero`)", "",
           f"The {len(mindzero.__all__)} names of `mindzero.__all__`: the pure ones import without MindSpore, the others "
           "on first use.", ""]
    for name in sorted(mindzero.__all__, key=str.lower):
        obj = getattr(mindzero, name)
        kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "constant"
        out += [f"### `{name}`", "", f"{kind}, from `{getattr(obj, '__module__', 'mindzero')}`" if kind != "constant"
                else "constant", ""]
        if kind == "constant":
            out += ["```python", f"{name} = {obj!r}", "```", ""]
        else:
            out += ["```python", signature(name, obj), "```", ""]
            paragraph = first_paragraph(obj)
            if paragraph:
                out += textwrap.wrap(paragraph, WIDTH, break_on_hyphens=False) + [""]
    return out


#: run in one fresh process: each tool's ``--help`` under the name a user types, at a fixed width
_HELPS = """
import contextlib, importlib, io, json, sys
out = {}
for command, target in json.loads(sys.argv[1]):
    module, function = target.split(":")
    sys.argv = [command, "--help"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        getattr(importlib.import_module(module), function)(["--help"])
    out[command] = text.getvalue()
print(json.dumps(out))
"""


def tools_section() -> list:
    import json

    env = dict(os.environ, COLUMNS=str(WIDTH), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _HELPS, json.dumps(TOOLS)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    if run.returncode:
        raise SystemExit(f"reference.py: the tools' --help failed:\n{run.stderr[-3000:]}")
    helps = json.loads(run.stdout)
    out = ["## Command-line tools", ""]
    for command, _ in TOOLS:
        if not helps[command].startswith("usage:"):
            raise SystemExit(f"reference.py: `{command} --help` printed no usage:\n{helps[command][:1000]}")
        out += [f"### `{command}`", "", "```text", helps[command].rstrip(), "```", ""]
    return out


def variables_section() -> list:
    from mindzero.core.options import VARIABLES

    out = ["## Environment variables", "", "| variable | read by | what it does |", "| --- | --- | --- |"]
    out += [f"| `{v.name}` | {v.read_by} | {v.does} |" for v in VARIABLES]
    return out + [""]


def page() -> str:
    lines = ["# Reference", "",
             "Generated from the code by `python scripts/reference.py --write`; `tests/single/test_reference.py` fails "
             "when the", "code and this page disagree. How to use these: [training.md](training.md); which options to "
             "choose:", "[choosing.md](choosing.md); every option of `prepare_train_network`: "
             "[training.md](training.md#the-options).", "",
             "- [The public API](#the-public-api-import-mindzero)", "- [Command-line tools](#command-line-tools)",
             "- [Environment variables](#environment-variables)", ""]
    lines += api_section() + tools_section() + variables_section()
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    text = page()
    if a.write:
        PAGE.write_text(text)
    elif a.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("docs/reference.md differs from the code: run `python scripts/reference.py --write`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

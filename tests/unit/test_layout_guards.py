"""Guards of the package layout (docs/architecture.md), pure: the core and the offline tools import without
MindSpore, every import (module level or inside a function) goes down the layers, no import cycle runs
through mindzero's modules, no module is over 500 lines and no function takes over 8 parameters (but
``prepare_train_network``, mindone's signature)."""
import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mindzero

PACKAGE = Path(mindzero.__file__).resolve().parent
# what must import without MindSpore: the pure core, the offline checkpoint tools, the launchers
PURE_PACKAGES = ("mindzero.core",)
PURE_MODULES = ("mindzero", "mindzero.checkpoint", "mindzero.checkpoint.format", "mindzero.checkpoint.tensor_io",
                "mindzero.checkpoint.source", "mindzero.checkpoint.offline", "mindzero.checkpoint.cli",
                "mindzero.checkpoint.directory",
                "mindzero.launch", "mindzero.launch.local", "mindzero.launch.mpi", "mindzero.launch.link",
                "mindzero.planner", "mindzero.planner.factory", "mindzero.planner.rehearse")


def _modules(package: str) -> list:
    path = PACKAGE.parent / package.replace(".", "/")
    return [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(path)])]


PURE = sorted({m for p in PURE_PACKAGES for m in _modules(p)} | set(PURE_MODULES))


def test_the_pure_list_covers_the_core():
    assert len([m for m in PURE if m.startswith("mindzero.core.")]) >= 9, PURE


@pytest.mark.parametrize("module", PURE)
def test_imports_without_mindspore(module):
    """Imported with ``mindspore`` blocked (any import of it fails), and MindSpore is not loaded after."""
    code = (f"import sys; sys.modules['mindspore'] = None; import {module}; "
            "print(sorted(m for m in sys.modules if m.startswith('mindspore') and sys.modules[m] is not None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict:
    """Module -> the mindzero modules it imports, at module level or inside a function (a lazy import is still
    a dependency: it runs when the function does)."""
    files = {_module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        base = name.split(".") if is_package else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join(base[:len(base) - node.level + 1] + ([module] if module else []))
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            for t in targets:
                if t in files and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def test_no_import_cycle():
    graph = _import_graph()
    assert len(graph) > 30 and graph["mindzero.engine.prepare"], "the graph must see the package"
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check is not vacuous: a planted cycle between two modules is found."""
    pkg = tmp_path / "mindzero"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("from .a import x\n")
    for i in range(31):
        (pkg / f"m{i}.py").write_text("")
    (pkg / "engine").mkdir()
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "prepare.py").write_text("from ..sub import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    with pytest.raises(AssertionError, match="import cycle: mindzero.sub.a -> mindzero.sub.b -> mindzero.sub.a"):
        test_no_import_cycle()


# the layers, bottom up: a folder imports only the folders listed for it (and itself); docs/architecture.md
LAYERS = {
    "core": (),
    "comm": ("core",),
    "engine": ("core", "comm"),
    "checkpoint": ("core", "comm", "engine"),
    "launch": ("core",),
    "planner": ("core", "comm", "engine"),
}
# the one module above its folder's layer: the worker side of a launch starts MindSpore's world
LAYER_EXCEPTIONS = {"mindzero.launch.worker": ("comm",)}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def layer_violations(graph: dict) -> list:
    """``module -> imported`` edges that go up or sideways between the folders of :data:`LAYERS`."""
    bad = []
    for module, edges in sorted(graph.items()):
        here = _folder(module)
        if not here:
            continue  # mindzero/__init__.py: the public table names every layer
        allowed = (here,) + LAYERS[here] + LAYER_EXCEPTIONS.get(module, ())
        bad += [f"{module} -> {t}" for t in sorted(edges) if _folder(t) and _folder(t) not in allowed]
    return bad


def test_imports_go_down_the_layers():
    graph = _import_graph()
    assert {_folder(m) for m in graph} >= set(LAYERS), "every layer has modules"
    assert layer_violations(graph) == []


def test_the_layer_check_finds_an_upward_import():
    """Not vacuous: an import inside a function, from comm up to engine, is found."""
    graph = {"mindzero.comm.cells": {"mindzero.core.topology"}, "mindzero.comm.x": {"mindzero.engine.kernels"},
             "mindzero.launch.local": {"mindzero.comm.groups"}, "mindzero.launch.worker": {"mindzero.comm.start"},
             "mindzero.engine.prepare": {"mindzero.planner.planner"}, "mindzero.planner.cli": {"mindzero.engine.fit"}}
    assert layer_violations(graph) == ["mindzero.comm.x -> mindzero.engine.kernels",
                                       "mindzero.engine.prepare -> mindzero.planner.planner",
                                       "mindzero.launch.local -> mindzero.comm.groups"]
    tree = ast.parse("def f():\n    from ..engine.kernels import MAP\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "engine.kernels" for n in ast.walk(tree))


MAX_LINES, MAX_PARAMETERS = 500, 8
#: mindone's signature, kept whole
WIDE_FUNCTIONS = {("mindzero.engine.prepare", "prepare_train_network")}


def size_violations(sources: dict) -> list:
    """``module (lines)`` over :data:`MAX_LINES` and ``module.function (parameters)`` over :data:`MAX_PARAMETERS`
    (``self``/``cls`` not counted) in ``{module: source}``."""
    bad = []
    for module, source in sorted(sources.items()):
        lines = source.count("\n")
        if lines > MAX_LINES:
            bad.append(f"{module} ({lines} lines)")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (module, node.name) in WIDE_FUNCTIONS:
                continue
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
            count = len(names) - (names[:1] in (["self"], ["cls"]))
            if count > MAX_PARAMETERS:
                bad.append(f"{module}.{node.name} ({count} parameters)")
    return bad


def test_modules_and_functions_stay_small():
    sources = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p.read_text()
               for p in PACKAGE.rglob("*.py")}
    assert size_violations(sources) == []


def test_the_size_check_finds_a_long_module_and_a_wide_function():
    wide = "class A:\n    def f(self, a, b, c, d, e, f, g, h, *rest):\n        pass\n" + "\n" * 500
    assert size_violations({"m": wide, "n": "def g(a, b, c, d, e, f, g, h):\n    pass\n"}) == ["m (503 lines)",
                                                                                            "m.f (9 parameters)"]

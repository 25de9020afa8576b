"""The user's factory as the planner sees it: a reference other processes can import (``module:function``, or a
script's path), the check that importing it runs nothing else, and the network built from it under
:func:`mindzero.lazy_init` with its largest list of repeated blocks found or cut (:class:`BlockLists`).

``factory`` is a zero-argument function returning ``(net_with_loss, optimizer)``, defined at a module's top level
(each rehearsal imports it again), building the optimizer from the network's parameters
(``net.trainable_params()``) so a cut network gets a cut optimizer.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np


def factory_ref(factory) -> str:
    """``"module:function"`` of a top-level function (a file path for a script's ``__main__``), or the string
    itself when it already is one.

    Raises:
        TypeError / ValueError: not a callable, or not importable by name (a lambda, a closure, a method).
    """
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"factory={factory!r}: expected 'module:function' (e.g. 'mypkg.models:build')")
        return factory
    if not callable(factory):
        raise TypeError(f"factory must be a zero-argument function returning (net_with_loss, optimizer), got "
                        f"{type(factory).__name__}")
    name, module = getattr(factory, "__qualname__", ""), getattr(factory, "__module__", None)
    if not name or "<" in name or "." in name or module is None:
        raise ValueError(f"factory={factory!r}: must be a function defined at a module's top level (each rehearsal "
                         "process imports it again by name); a lambda, closure or method cannot be")
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise ValueError(f"factory={name}: defined in an interactive session; put it in a module")
        module = str(Path(path).resolve())
        check_importable_script(module, name)
    return f"{module}:{name}"


def top_level_code(source: str) -> list:
    """``(line, text)`` of each top-level statement of a script that runs code when the script is imported: all
    but imports, definitions (functions, classes), a docstring, assignments of literals and names, and the
    ``if __name__ == "__main__":`` block. Pure (the script is parsed, not run)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _inert(node.value):
            continue
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            continue
        found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def _inert(value) -> bool:
    """An expression that runs nothing of the user's: literals, names, attributes, and containers of them."""
    return all(isinstance(n, (ast.Constant, ast.Name, ast.Attribute, ast.Tuple, ast.List, ast.Set, ast.Dict,
                              ast.Load, ast.UnaryOp, ast.USub, ast.BinOp, ast.operator))
               for n in ast.walk(value))


def _is_main_guard(test) -> bool:
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    consts = {n.value for n in ast.walk(test) if isinstance(n, ast.Constant)}
    return isinstance(test, ast.Compare) and "__name__" in names and "__main__" in consts


def check_importable_script(path: str, name: str) -> None:
    """A factory defined in the running script is rehearsed by importing that script in a fresh process, so the
    script must not run code at its top level (its argument parsing, ``init()``, its training loop).

    Raises:
        ValueError: naming the first such line and the two remedies.
    """
    code = top_level_code(Path(path).read_text())
    if code:
        line, text = code[0]
        more = f" (and {len(code) - 1} more)" if len(code) > 1 else ""
        raise ValueError(
            f"factory={name}: defined in the script {path}, which runs code at its top level (line {line}: "
            f"{text!r}{more}); each rehearsal process imports the script to find the factory and would run that "
            "code again, with the rehearsal's arguments and outside your launch. Define the factory in a module "
            "the script imports, or put the script's top-level code under `if __name__ == \"__main__\":`")


def load_factory(ref: str):
    """The function of a ``module:function`` (or ``/path/file.py:function``) reference."""
    module, _, name = ref.rpartition(":")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_mindzero_factory", module)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(module).parent))
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    try:
        return getattr(mod, name)
    except AttributeError:
        raise ValueError(f"factory={ref!r}: module {module!r} has no {name!r}") from None


class BlockLists:
    """While the factory runs: record every list of two or more identical Cells built (``nn.CellList`` /
    ``nn.SequentialCell``: same class, same parameter shapes and dtypes) in the order built, or cut the
    ``cut``-th of them to its first ``depth`` Cells (the others are never reachable, so never materialised)."""

    def __init__(self, cut: int = None, depth: int = None):
        self.cut, self.depth, self.found, self.kept = cut, depth, [], None

    def largest(self) -> dict:
        """The record of the list the planner cuts: the most parameters in all (blocks x a block's elements)."""
        return max(self.found, key=lambda f: f["length"] * f["block_numel"])

    @staticmethod
    def _signature(cell):
        return type(cell), tuple((tuple(p.shape), str(p.dtype)) for p in cell.get_parameters())

    def _filter(self, items):
        from mindspore import nn

        items = list(items)
        if len(items) < 2 or not all(isinstance(c, nn.Cell) for c in items):
            return items
        sig = self._signature(items[0])
        if not sig[1] or any(self._signature(c) != sig for c in items[1:]):
            return items
        index = len(self.found)
        numel = sum(int(np.prod(s)) for s, _ in sig[1])
        self.found.append(dict(index=index, length=len(items), cls=sig[0].__name__, block_numel=numel, cells=items))
        if index == self.cut:
            items = items[:self.depth]
            self.kept = items
        return items

    @contextlib.contextmanager
    def active(self):
        from mindspore import nn

        lists, seq = nn.CellList.__init__, nn.SequentialCell.__init__
        me = self

        def cell_list(self_, items=None, *args, **kwargs):
            return lists(self_, me._filter(items) if items is not None else items, *args, **kwargs)

        def sequential(self_, *args):
            if len(args) == 1 and isinstance(args[0], list):
                args = (me._filter(args[0]),)
            return seq(self_, *args)

        nn.CellList.__init__, nn.SequentialCell.__init__ = cell_list, sequential
        try:
            yield self
        finally:
            nn.CellList.__init__, nn.SequentialCell.__init__ = lists, seq


def build(ref: str, cut: int = None, depth: int = None, kwargs: dict = None):
    """``(net, optimizer, lists)``: the factory's network built under ``lazy_init`` (nothing materialised), the
    ``cut``-th repeated list cut to ``depth``; ``kwargs``: the factory's keyword arguments."""
    from ..engine.materialize import lazy_init

    factory = load_factory(ref)
    lists = BlockLists(cut, depth)
    with lazy_init(), lists.active():
        made = factory(**(kwargs or {}))
    if not (isinstance(made, tuple) and len(made) == 2):
        raise TypeError(f"factory {ref!r} must return (net_with_loss, optimizer), got {type(made).__name__}")
    return made[0], made[1], lists


def block_list_name(net, cells) -> str:
    """The attribute path of the list holding ``cells`` in ``net`` (for ``gather_units``), or ``None``."""
    for name, cell in net.cells_and_names():
        if name and cell is cells[0]:
            return name.rsplit(".", 1)[0] if "." in name else None
    return None



"""What the plan needs to know of a user's Cell, read from its Python API and its classes' source (pure: no
MindSpore import): the :class:`~mindzero.core.plan.ParamInfo` of each parameter (:func:`param_infos`, the one
definition of an *optimized* parameter), which Parameters the network writes (:func:`written_buffers`:
buffers stay per rank) and which a mixed-precision run keeps in fp32 (:func:`kept_fp32`)."""
from __future__ import annotations

import ast
import inspect
import re

from .plan import ParamInfo


def kept_fp32(network) -> set:
    """Ids of the Parameters whose owning Cell computes in fp32 (``to_float(ms.float32)``, what
    ``auto_mixed_precision`` does to BatchNorm and LayerNorm): a mixed-precision run keeps them in fp32."""
    out = set()
    for _, cell in network.cells_and_names():
        if cell.get_flags().get("fp32"):
            out.update(id(p) for p in cell._params.values() if p is not None)
    return out


def param_infos(network, precision, optimizer=None) -> list:
    """The :class:`ParamInfo` of ``network``'s parameters (``get_parameters()`` order) as the plan sees them,
    dtypes as held under ``precision`` (a :class:`mindzero.core.config.MixedPrecision`).

    The one definition of an *optimized* parameter, shared by ``prepare_train_network`` and the estimate:
    one ``optimizer`` updates; without an optimizer (the estimate from a Cell), one with ``requires_grad``,
    which is what ``network.trainable_params()`` hands an optimizer. Pure: it reads the Cell's Python API.
    """
    if optimizer is not None:
        ids = {id(p) for p in optimizer.parameters}
        optimized = lambda p: id(p) in ids  # noqa: E731
    else:
        optimized = lambda p: bool(p.requires_grad)  # noqa: E731
    keep = kept_fp32(network) if precision.enabled else set()
    written = written_buffers(network)
    return [ParamInfo(p.name, tuple(p.shape), precision.held(str(p.dtype).lower(), optimized(p), id(p) in keep),
                      optimized(p), bool(getattr(p, "parallel_optimizer", True)), p.name in written)
            for p in network.get_parameters()]


# a call that writes its first argument: ops.assign, ops.assign_add, P.Assign()(...), ops.scatter_update, ...
_WRITES = re.compile(r"assign|scatter|update|set_data", re.IGNORECASE)
_SELF_CALLS = {}  # class -> the calls on self.<attr> of its own source (see _self_calls)


def written_buffers(network) -> dict:
    """``{parameter name: why}`` for every Parameter of ``network`` that the network writes (a buffer):

    * the moving statistics of MindSpore's BatchNorm layers (``_BatchNorm`` subclasses: BatchNorm1d/2d/3d,
      SyncBatchNorm), which the BatchNorm kernel updates;
    * a Parameter ``self.<attr>`` of a Cell whose class (or a base class below MindSpore's ``Cell``) passes it
      as the first argument of a write: a call named like one (``ops.assign(self.buf, v)``,
      ``P.ScatterUpdate()(self.table, i, v)``, ``self.assign_add(self.n, one)``), a call of a primitive the
      Cell holds whose name is (``self.add = ops.AssignAdd()``; ``self.add(self.n, one)``), or such a method
      of it (``self.buf.assign_value(v)``);
    * every Parameter of a Cell whose class's source cannot be read (so no write can be ruled out).

    Pure: reads the Cells' Python classes (``inspect``, ``ast``), not MindSpore's graph. A parameter the rule
    misses (written through a helper function or another Cell) can be kept replicated with
    ``param.parallel_optimizer = False``.
    """
    out = {}
    for _, cell in network.cells_and_names():
        cls = type(cell)
        mro = [c.__name__ for c in cls.__mro__]
        calls = _self_calls(cls)
        for attr, p in list(cell._params.items()):
            if p is None:
                continue
            if "_BatchNorm" in mro and attr in ("moving_mean", "moving_variance"):
                out[p.name] = f"{cls.__name__} updates its moving statistics"
            elif calls is None:
                out[p.name] = f"the source of {cls.__name__} cannot be read to rule out a write"
            else:
                for where, callee, target in calls:
                    if target == attr and _is_write(cell, callee):
                        out[p.name] = f"{where} writes self.{attr}"
                        break
    return out


def _is_write(cell, callee) -> bool:
    """Whether ``callee`` (a name, or ``("self", attr)``: a primitive the Cell holds) writes its first input."""
    if isinstance(callee, tuple):
        held = getattr(cell, callee[1], None)
        return bool(_WRITES.search(callee[1]) or _WRITES.search(type(held).__name__)
                    or _WRITES.search(str(getattr(held, "name", ""))))
    return bool(_WRITES.search(callee))


def _self_calls(cls):
    """``[(where, callee, attr)]``: every call in ``cls``'s own code (and its bases' below MindSpore's
    ``Cell``) whose first argument is ``self.<attr>`` (or that is a method of ``self.<attr>``); ``callee`` is
    the called name, or ``("self", name)`` for a call of ``self.<name>``. ``None`` if some source cannot be
    read. Cached per class."""
    if cls not in _SELF_CALLS:
        found = []
        for klass in cls.__mro__:
            if klass.__module__.startswith("mindspore.nn.cell") or klass is object:
                break  # MindSpore's Cell and what it is built on write no Parameter of a subclass
            try:
                tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(klass)))
            except (OSError, TypeError, SyntaxError):
                found = None
                break
            for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
                found += [(f"{klass.__name__}.{fn.name}", callee, attr) for callee, attr in _calls_on_self(fn)]
        _SELF_CALLS[cls] = found
    return _SELF_CALLS[cls]


def _calls_on_self(function):
    def self_attr(node):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        return None

    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        while isinstance(func, ast.Call):  # P.Assign()(...)
            func = func.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        callee = ("self", name) if self_attr(func) else name
        if node.args and self_attr(node.args[0]):
            yield callee, self_attr(node.args[0])
        if isinstance(func, ast.Attribute) and self_attr(func.value):  # self.buf.assign_value(v)
            yield name, self_attr(func.value)

"""The train step's compiled graph kept on disk, under a key of everything that shapes it (``compile_cache``).

MindSpore's compile cache (``MS_COMPILER_CACHE_ENABLE=1``) saves the graph a process compiles and loads it in
the next process instead of compiling again; it checks only the source files of the entry script and the local
modules it imports. A step built from the same script with another ``zero_stage``, world size, rank, model size,
batch shape, optimizer setting or mindzero version compiles into another graph, yet MindSpore loads the saved one
("Use the compilation cache and execute the backend actions only. Be aware of correctness risks"): a stage-1 step
that loads a stage-3 step's cache aborts in its first run (``free(): invalid pointer``).

So mindzero caches its own step in a directory of its own, ``<root>/<key>/``, where the key is a digest of:

- every Cell of the step (the user's network and optimizer, mindzero's Cells): its class and the source files of
  its classes; the attributes a graph reads as constants (numbers, strings, bools, dtypes, containers of them,
  Tensors that are not Parameters, byte for byte, primitives and their attributes);
- every Parameter's name, shape, dtype and ``requires_grad`` (their values are read at each run, never cached);
- the inputs of the first call (shapes and dtypes of Tensors, values of Python scalars);
- the options (:class:`~mindzero.core.config.ZeroConfig`), this rank's world, MindSpore's and mindzero's versions
  and mindzero's source, the device and MindSpore's ``MS_DEV_*`` variables.

Only the step's compile runs with the cache on: MindSpore's setting is restored as soon as it ends, so the user's
own graphs compile as they would without mindzero. ``<root>`` is ``compile_cache``; without it, when the user
turned MindSpore's cache on for the whole process, ``<MindSpore's cache path>/mindzero``, so that the step's graph
never lands where MindSpore would load it for another step. A key's directory is marked complete after a
successful compile; one without the mark (a compile that was killed) is removed before the next compile.

Not seen by the key: a value that ``construct`` reads from a module-level global set at run time, or a helper
function of an installed package that is not in the file of one of the step's Cell classes; clear the directory
(or give another ``compile_cache``) when such a thing changes.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn
from mindspore.ops import Primitive

COMPLETE = "complete.json"  # written into a key's directory once its step compiled
_MINDSPORE_DIR = str(Path(ms.__file__).resolve().parent)
_MINDZERO_DIR = Path(__file__).resolve().parents[1]
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_FILE_DIGESTS: dict = {}
_READ_NAMES: dict = {}
_DESCRIBING: set = set()  # ids of the Cells being described (a Cell that holds its holder)
_CELL_ATTRIBUTES = None  # the attributes every nn.Cell has (MindSpore's bookkeeping, not the user's)
#: what MindSpore keeps on every Cell that changes its graph: the mode, ``to_float``, ``recompute``, flags, a bprop
_CELL_SETTINGS = frozenset({"training", "mixed_precision_type", "_amp_level", "_has_config_recompute", "_scope",
                            "_jit_config_dict", "has_bprop", "_func_graph_flags", "cell_type"})
_WARNED = False  # the process-wide cache's warning was given
_LATCHED = None  # the cache directory MindSpore fixed for this process (at the first step compiled with it)
logger = logging.getLogger("mindzero")


def process_wide_cache() -> bool:
    """Whether MindSpore's compile cache is on for the whole process (``set_context(enable_compile_cache=True)``,
    else ``MS_COMPILER_CACHE_ENABLE=1``)."""
    enabled = ms.get_context("enable_compile_cache")
    return os.environ.get("MS_COMPILER_CACHE_ENABLE") == "1" if enabled is None else bool(enabled)


@contextlib.contextmanager
def without_process_cache():
    """Compile inside with MindSpore's process-wide compile cache off, when it is on (warned once): it checks
    only the script's source files, so a graph of mindzero's built with other settings (another stage, world,
    model or batch) would load this one's."""
    global _WARNED
    if not process_wide_cache():
        yield
        return
    if not _WARNED:
        _WARNED = True
        logger.warning("MindSpore's compile cache is on for this process (MS_COMPILER_CACHE_ENABLE or "
                       "enable_compile_cache): it checks only the script's source files, so mindzero compiles its "
                       "graphs without it (a train step of other settings would load this one's graph and fail); "
                       "to keep the train step compiled, turn it off and pass compile_cache=DIR to "
                       "prepare_train_network, which keys the step by everything that shapes it")
    context, param = ms.context._context(), ms.context.ms_ctx_param
    with _cache_set(False, False, context.get_param(param.compile_cache_path)):
        yield


def step_key(step, args, config, world) -> str:
    """The digest of everything that shapes ``step``'s compiled graph for the call ``step(*args)``."""
    h = hashlib.sha256()

    def add(*parts):
        for part in parts:
            h.update(_ADDRESS.sub("", str(part)).encode())
            h.update(b"\0")

    add(ms.__version__, sys.version_info[:2], _package_digest(), ms.get_context("device_target"),
        sorted((k, v) for k, v in os.environ.items() if k.startswith("MS_DEV_")))
    # where disk offload keeps its files and whether they stay shape no graph (a job's scratch path changes)
    add(dataclasses.replace(config, compile_cache=None, verbose=False,
                            offload=dataclasses.replace(config.offload, dir=None, keep=False)), world)
    for name, cell in step.cells_and_names():
        add(name, _cell_text(cell))
    for name, p in step.parameters_and_names():
        add(name, p.name, p.shape, p.dtype, p.requires_grad)
    add(describe_inputs(args))
    return h.hexdigest()


def describe_inputs(args) -> str:
    """The call's inputs as the graph depends on them: Tensors by shape and dtype, other values as they are."""
    return describe(tuple(args), contents=False)


def describe(value, contents: bool = True) -> str:
    """A deterministic text of what a graph reads from ``value`` as a constant (Tensors byte for byte, unless
    ``contents`` is false: then by shape and dtype, as a graph's inputs)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, Parameter):
        return f"Parameter:{value.name}"
    if isinstance(value, (Tensor, np.ndarray)):
        data = value.asnumpy() if isinstance(value, Tensor) and contents else value
        digest = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest() if contents else ""
        return f"{type(value).__name__}:{value.dtype}:{tuple(value.shape)}:{digest}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({','.join(describe(v, contents) for v in value)})"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{describe(k)}={describe(v, contents)}" for k, v in
                                  sorted(value.items(), key=lambda kv: repr(kv[0]))) + ")"
    if isinstance(value, nn.Cell):  # a Cell held in a container is not among the step's cells_and_names
        if id(value) in _DESCRIBING:
            return f"Cell:{type(value).__qualname__}:(cycle)"
        _DESCRIBING.add(id(value))
        try:
            return "Cell(" + ",".join(f"{name}:{_cell_text(cell)}" for name, cell in value.cells_and_names()) + ")"
        finally:
            _DESCRIBING.discard(id(value))
    if isinstance(value, Primitive):
        return f"Primitive:{value.name}:{describe(dict(value.attrs))}"
    if isinstance(value, ms.dtype.Type):
        return f"dtype:{value}"
    if inspect.isfunction(value) or inspect.ismethod(value):
        return f"function:{value.__module__}.{value.__qualname__}:{_file_digest(inspect.getsourcefile(value))}"
    kind = type(value)
    return f"object:{kind.__module__}.{kind.__qualname__}"  # its effect on the graph is in the Cells' attributes


def _cell_text(cell) -> str:
    kind = type(cell)
    return f"{kind.__module__}.{kind.__qualname__}:{_class_files(kind)}:{_attributes(cell)}"


def _attributes(cell) -> str:
    """The attributes of ``cell`` that shape its graph, described: those its methods read (:func:`_read_names`)
    and MindSpore's settings of a Cell (:data:`_CELL_SETTINGS`); MindSpore's other bookkeeping left out."""
    global _CELL_ATTRIBUTES
    if _CELL_ATTRIBUTES is None:
        _CELL_ATTRIBUTES = frozenset(vars(nn.Cell())) - _CELL_SETTINGS
    names = _read_names(type(cell))
    own = {k: v for k, v in vars(cell).items() if k not in _CELL_ATTRIBUTES and not isinstance(v, nn.Cell)
           and (names is None or k in names or k in _CELL_SETTINGS)}
    return describe(own)


def _read_names(cls):
    """The attribute names ``self.<name>`` the methods of ``cls`` and its bases below ``nn.Cell`` read outside
    ``__init__`` (what a graph can see; an initial value kept by ``__init__`` alone, such as ``nn.Embedding``'s
    ``init_tensor``, is not); ``None`` (every attribute) where a source is unreadable or reads ``getattr(self,
    ...)``."""
    if cls not in _READ_NAMES:
        names = set()
        for base in cls.__mro__[:cls.__mro__.index(nn.Cell)]:
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
            except (TypeError, OSError, SyntaxError):
                names = None
                break
            methods = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and n.name != "__init__"]
            nodes = [node for method in methods for node in ast.walk(method)]
            if any(isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "vars") for n in nodes):
                names = None
                break
            names |= {n.attr for n in nodes if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"}
        _READ_NAMES[cls] = names
    return _READ_NAMES[cls]


def _class_files(cls) -> list:
    """Digests of the source files defining ``cls`` and its bases (MindSpore's own files: its version covers them)."""
    files = []
    for base in cls.__mro__:
        try:
            path = inspect.getsourcefile(base)
        except (TypeError, OSError):
            continue
        if path and not str(Path(path).resolve()).startswith(_MINDSPORE_DIR):
            files.append(f"{path}:{_file_digest(path)}")
    return files


def _file_digest(path) -> str:
    if path is None:
        return "-"
    if path not in _FILE_DIGESTS:
        try:
            _FILE_DIGESTS[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            _FILE_DIGESTS[path] = "unreadable"
    return _FILE_DIGESTS[path]


def _package_digest() -> str:
    """mindzero's own source: its graph kernels are functions of its modules."""
    h = hashlib.sha256()
    for path in sorted(_MINDZERO_DIR.rglob("*.py")):
        h.update(str(path.relative_to(_MINDZERO_DIR)).encode())
        h.update(_file_digest(str(path)).encode())
    return h.hexdigest()


@contextlib.contextmanager
def cached_compile(step, args, config, world):
    """Compile ``step`` for ``step(*args)`` inside this context with MindSpore's compile cache in
    ``<config.compile_cache>/<key>/`` (:func:`step_key`), then restore MindSpore's setting. A directory without its completion
    mark (a killed compile) is removed first; the mark is written once the compile returned and MindSpore's files
    are there.

    MindSpore fixes its cache directory at the first compile of a process that uses the cache: a second step of
    another key in the process compiles without the cache (warned). With MindSpore's cache on for the whole
    process the step compiles without any (:func:`without_process_cache`).
    """
    global _LATCHED
    if config.compile_cache is None or process_wide_cache():
        with without_process_cache():
            yield
        return
    script = _entry_script()
    if not os.path.isfile(script):
        logger.warning("compile_cache: the train step compiles without the cache: MindSpore's cache reads the "
                       "script the process runs (it hashes its source), and this process runs %r, not a file "
                       "(python -c, an interactive session)", script)
        yield
        return
    key = step_key(step, args, config, world)
    directory = (Path(config.compile_cache) / key[:24]).resolve()
    if _LATCHED is not None and _LATCHED != directory:
        logger.warning("compile_cache: the train step compiles without the cache: MindSpore keeps one cache "
                       "directory per process, and this process's is %s (a train step built with other settings "
                       "or inputs)", _LATCHED)
        yield
        return
    if directory.exists() and not (directory / COMPLETE).exists():
        shutil.rmtree(directory, ignore_errors=True)
    cached = (directory / COMPLETE).exists()
    directory.mkdir(parents=True, exist_ok=True)
    _LATCHED = directory
    with _cache_set(True, True, str(directory)):
        yield
    if not cached and not any(directory.rglob("*.mindir")):
        logger.warning("compile_cache: MindSpore kept no graph of the train step in %s", directory)
        return
    logger.info("train step %s %s", "loaded from the compile cache in" if cached else "compiled and cached in",
                directory)
    summary = {"key": key, "zero_stage": config.zero_stage, "world": repr(world), "mindspore": ms.__version__,
               "inputs": describe_inputs(args)[:2000]}
    tmp = directory / (COMPLETE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, directory / COMPLETE)


def mindspore_api():
    """MindSpore's module that holds ``entry_script_path`` (``mindspore.graph.api``; before 2.9
    ``mindspore.common.api``)."""
    try:
        from mindspore.graph import api
    except ImportError:
        from mindspore.common import api
    return api


def _entry_script() -> str:
    """The script MindSpore's cache takes for the process's (its source is hashed into the cached graph's check)."""
    return mindspore_api().entry_script_path or ""


@contextlib.contextmanager
def _cache_set(setting, switch, path):
    """Inside: MindSpore's compile-cache setting (``None``: not set, its environment variable decides), its switch in
    the C++ context and its path, set as ``set_context`` sets them (without its notice that the setting moves to an
    environment variable); after: the three as they were."""
    context, param = ms.context._context(), ms.context.ms_ctx_param

    def put(setting, switch, path):
        context.enable_compile_cache = setting
        context.set_param(param.enable_compile_cache, switch)
        context.set_param(param.compile_cache_path, path)

    previous = (context.enable_compile_cache, context.get_param(param.enable_compile_cache),
                context.get_param(param.compile_cache_path))
    put(setting, switch, path)
    try:
        yield
    finally:
        put(*previous)

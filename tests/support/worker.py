"""The worker side of a test launch: start (the library's worker protocol) and train a :class:`~tests.support.scenarios.Scenario`."""
import contextlib
import gc
import tempfile
from dataclasses import dataclass

import numpy as np
from mindspore import amp, nn

import mindzero
from mindzero.core.checksum import crc32_array
from mindzero.comm import substitute_collectives
from mindzero.launch.worker import start_worker

from .data import batch, concat
from .models import TORCH_STYLE, build, make_optimizer, runs_here


def settle():
    """Before each scenario of a launch: collect what the earlier ones left, then move every object still alive out
    of the cyclic collector's sight (``gc.freeze``). MindSpore runs a full ``gc.collect()`` before every graph it
    compiles, whose time grows with the objects the process holds, and MindSpore keeps every compiled train step
    alive: without this, a launch of 60 scenarios spends 0.14 s and, by its end, 0.23 s a compile collecting, and the
    launch takes about a tenth longer. Only objects alive here are frozen (they stay, as they would)."""
    gc.collect()
    gc.freeze()


def start(parser=None):
    """:func:`mindzero.launch.worker.start_worker`: arguments with ``--out``, the data-parallel world, this
    rank's directory."""
    return start_worker(parser)


_OFFLOAD_DIRS = []  # held until the process ends, when each removes itself (a train step may use its file till then)


def _offload_dir() -> str:
    folder = tempfile.TemporaryDirectory(prefix="mindzero_offload_")
    _OFFLOAD_DIRS.append(folder)
    return folder.name


@dataclass
class Run:
    arrays: dict  # losses, overflows, scales, data (CRC-32 of each input), emulated, param/<name> (@init, @ema, @master)
    memory: dict  # mindzero.memory_report (None for plain data parallel)
    train: object  # the train step


class ReferenceStep:
    """Plain data parallel as MindSpore's functional API writes it (for optimizers ``nn.TrainOneStepCell`` does
    not take, such as ``mint.optim``'s): ``mindspore.value_and_grad`` over the optimizer's parameters,
    ``DistributedGradReducer``'s mean over the world, ``ops.clip_by_global_norm`` when ``clip_norm`` is set, then
    the optimizer, in one ``mindspore.jit`` function. Called like ``nn.TrainOneStepCell``: returns the loss."""

    def __init__(self, net, opt, clip_norm=None):
        import mindspore as ms
        from mindspore import ops
        from mindspore.nn.wrap.grad_reducer import DistributedGradReducer

        grad_fn = ms.value_and_grad(net, None, opt.parameters)
        reducer = DistributedGradReducer(opt.parameters, mean=True)  # the mean over the world

        @ms.jit
        def step(*inputs):
            loss, grads = grad_fn(*inputs)
            grads = reducer(grads)
            if clip_norm is not None:
                grads = ops.clip_by_global_norm(grads, clip_norm)
            return ops.depend(loss, opt(grads))

        self.step = step

    def __call__(self, *inputs):
        return self.step(*inputs)


@contextlib.contextmanager
def plain_data_parallel():
    """MindSpore's DATA_PARALLEL context with ``gradients_mean=True`` for the block, then the context as it was: what
    ``nn.TrainOneStepCell`` reduces its gradients by (it reads the context when built). mindzero needs none:
    ``start_data_parallel`` sets none, so a launch's mindzero scenarios run with the context unset (:func:`run`
    checks it)."""
    import mindspore as ms

    before = {k: ms.get_auto_parallel_context(k) for k in ("parallel_mode", "gradients_mean")}
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    try:
        yield
    finally:
        ms.set_auto_parallel_context(**before)


def without_parallel_context() -> None:
    """Fail unless MindSpore's static-graph parallel context is unset (``stand_alone``), as mindzero's runs need."""
    import mindspore as ms

    mode = ms.get_auto_parallel_context("parallel_mode")
    if mode != "stand_alone":
        raise AssertionError(f"a mindzero run must need no auto-parallel context, but parallel_mode is {mode!r}")


def run(scn, world) -> Run:
    """Train ``scn`` on this rank of ``world`` (the whole world: data by world rank): plain DP under MindSpore's
    DATA_PARALLEL context, mindzero's stages with the context unset, in the scenario's mode (graph mode after)."""
    import mindspore as ms

    if not runs_here(scn.optimizer):
        return refused(scn)
    if scn.stage == "dp":
        with plain_data_parallel():
            return _run(scn, world)
    without_parallel_context()
    ms.set_context(mode=ms.PYNATIVE_MODE if scn.mode == "pynative" else ms.GRAPH_MODE)
    try:
        return _run(scn, world)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def refused(scn) -> Run:
    """A scenario whose optimizer this MindSpore ships but does not run: what ``prepare_train_network`` raises for it
    (``arrays["refused"]``), and nothing trained (plain DP's rows record the same message: they would train nothing)."""
    from mindzero.core.versions import UnsupportedMindSpore

    net = build(scn.model)
    try:
        mindzero.prepare_train_network(net, make_optimizer(scn.optimizer, net), zero_stage=1)
        message = ""
    except UnsupportedMindSpore as err:
        message = str(err)
    return Run({"refused": np.array(message)}, None, None)


def _run(scn, world) -> Run:
    settle()
    net = build(scn.model)
    init_params = {"init/" + p.name: p.asnumpy().copy() for p in net.trainable_params()}
    cls = type(net)
    opt = make_optimizer(scn.optimizer, net)
    if scn.mixed_precision and scn.amp == "O2":  # fp16 compute, BatchNorm/LayerNorm in fp32 (AMP O2)
        net = amp.auto_mixed_precision(net, "O2")
    elif scn.mixed_precision and scn.amp == "partial":  # the backbone only; the loss Cell as built
        net._backbone = amp.auto_mixed_precision(net._backbone, "O2")
    k = scn.accumulation
    if scn.stage == "dp" and scn.optimizer in TORCH_STYLE:
        net.set_train()
        train = ReferenceStep(net, opt, scn.settings["clip_norm"] if scn.settings.get("clip_grad") else None)
    elif scn.stage == "dp":
        train = nn.TrainOneStepCell(net, opt)
        train.set_train()
    else:
        # substitute: the GPU/Ascend code path, CPU-legal primitives (mindzero.comm.substitute_collectives)
        settings = scn.settings
        if settings.get("optimizer_offload") == "disk":  # each run its own directory, removed when the process ends
            settings = {**settings, "offload_dir": _offload_dir()}
        with substitute_collectives() if scn.substitute else contextlib.nullcontext():
            train = mindzero.prepare_train_network(net, opt, zero_stage=scn.stage, config=settings)
    losses, overflows, scales, seen = [], [], [], []
    for step in range(scn.steps):
        if scn.stage == "dp" and k > 1:  # plain DP on the concatenated micro-batches
            inputs = concat([batch(cls, step, world.world_rank, m, n=2) for m in range(k)])
            seen.append(crc32_array(inputs[0].asnumpy()))
            losses.append(float(train(*inputs).asnumpy()))
            continue
        for m in range(k):
            inputs = batch(cls, step, world.world_rank, m, n=2 if k > 1 else None)
            seen.append(crc32_array(inputs[0].asnumpy()))
            if scn.force_overflow and step == 4 and world.world_rank == world.world_size - 1:
                x = inputs[0].asnumpy().copy()
                x.flat[0] = np.inf  # forced overflow on the last rank only
                inputs[0] = type(inputs[0])(x)
            out = train(*inputs)
            if scn.stage == "dp":
                losses.append(float(out.asnumpy()))
            else:
                losses.append(float(out[0].asnumpy()))
                overflows.append(bool(out[1].asnumpy()))
                scales.append(float(out[2].asnumpy()))
    if scn.stage == "dp":
        params = {p.name: p.asnumpy() for p in net.get_parameters()}
        params.update({k[len("init/"):] + "@init": v for k, v in init_params.items()})
        memory, path = None, {}
    else:
        params = mindzero.gather_full_state_dict(train)
        if scn.settings.get("ema"):
            params.update({name + "@ema": v for name, v in mindzero.gather_full_state_dict(train, ema=True).items()})
        if scn.mixed_precision:
            params.update({name + "@master": v
                           for name, v in mindzero.gather_full_state_dict(train, masters=True).items()})
        memory = mindzero.memory_report(train)
        # emulated False: the GPU/Ascend code path ran (on CPU: substitute_collectives)
        path = {"emulated": np.array(train.zero_info.world.emulated)}
    arrays = dict(losses=np.array(losses), overflows=np.array(overflows), scales=np.array(scales),
                  data=np.array(seen, np.int64), **path,
                  **{"param/" + n: v for n, v in params.items()})
    return Run(arrays, memory, train)


@contextlib.contextmanager
def counting_collectives():
    """PyNative: every call of MindSpore's ``AllReduce``, ``AllGather`` and ``ReduceScatter`` primitives while the
    block runs, as ``(op, bytes)`` in the yielded list (an all-gather's output, the others' input), and
    ``{op: {"calls", "bytes"}}`` from :func:`tally`; the steps run op by op (``MINDZERO_PYNATIVE_OP_BY_OP``), so
    every call reaches the primitive. Restores the primitives, the variable and graph mode after."""
    import os

    import mindspore as ms
    from mindspore import ops

    counted, originals = [], {}
    for cls, op in ((ops.AllReduce, "all_reduce"), (ops.AllGather, "all_gather"), (ops.ReduceScatter, "reduce_scatter")):
        def counting(self, *args, _orig=cls.__call__, _op=op):
            out = _orig(self, *args)
            counted.append((_op, int((out if _op == "all_gather" else args[0]).nbytes)))
            return out
        originals[cls] = cls.__call__
        cls.__call__ = counting
    before = os.environ.get("MINDZERO_PYNATIVE_OP_BY_OP")
    os.environ["MINDZERO_PYNATIVE_OP_BY_OP"] = "1"
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        yield counted
    finally:
        for cls, call in originals.items():
            cls.__call__ = call
        if before is None:
            os.environ.pop("MINDZERO_PYNATIVE_OP_BY_OP")
        else:
            os.environ["MINDZERO_PYNATIVE_OP_BY_OP"] = before
        ms.set_context(mode=ms.GRAPH_MODE)


def tally(counted) -> dict:
    """``{op: {"calls", "bytes"}}`` of :func:`counting_collectives`' list."""
    got = {op: {"calls": 0, "bytes": 0} for op in ("all_reduce", "all_gather", "reduce_scatter")}
    for op, nbytes in counted:
        got[op]["calls"] += 1
        got[op]["bytes"] += nbytes
    return got

"""Will it fit? :func:`predict_peak` and :func:`plan`: each rank's peak predicted from rehearsals of small replicas
of the user's network (:mod:`mindzero.planner.rehearse`; the model and its arithmetic: :mod:`mindzero.core.fit`),
and the configuration to use within a budget.

A replica is the factory's network with ``d`` of its repeated blocks (the largest ``nn.CellList`` or
``nn.SequentialCell`` of identical Cells, cut to its first ``d`` as it is built: :mod:`mindzero.planner.factory`);
two depths give the per-block terms, a second batch the per-sample ones. Up to ``jobs`` rehearsals run at once.
"""
from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..core.fit import (MIB, Fit, Prediction, accumulation_choices, fit_depth, keeps_gathers, kept_gathers_per_block,
                        parse_bytes, recommend, table, transient_bytes, with_batch_terms)
from ..core.checks import require_int
from ..core.config import ZeroConfig
from ..core.plan import dtype_bytes
from .factory import block_list_name, build, factory_ref
from .rehearse import run_child

DEFAULT_DEPTHS = (1, 2)
DEFAULT_MARGIN = 0.10  # above the largest error of a prediction against real launches (docs/performance.md)
SEARCH_KEYS = ("stages", "param_dtype", "recompute", "global_batch", "quantization")  # what plan() weighs


@dataclass(frozen=True)
class Rehearsal:
    """How the planner rehearses: ``depths`` (the block counts of the two replicas), ``jobs`` (rehearsals at once,
    each a process), ``timeout`` (seconds per rehearsal), ``progress`` (a function called with a line per step,
    e.g. ``print``) and ``factory_kwargs`` (the factory's keyword arguments, JSON-able: a width or a depth).
    Validated on construction."""

    depths: tuple = DEFAULT_DEPTHS
    jobs: int = 2
    timeout: float = 900
    progress: Optional[Callable] = None
    factory_kwargs: Optional[dict] = None

    def __post_init__(self):
        d = tuple(self.depths)
        if len(d) != 2 or not all(isinstance(x, int) for x in d) or d[0] >= d[1] or d[0] < 1:
            raise ValueError(f"depths={self.depths!r}: two block counts, the first >= 1 and smaller than the second")
        require_int("jobs", self.jobs, 1)
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: must be seconds > 0")
        if self.progress is not None and not callable(self.progress):
            raise ValueError(f"progress={self.progress!r}: must be a function of one line (e.g. print) or None")
        json.dumps(self.factory_kwargs or {})  # each rehearsal process receives them as JSON
        object.__setattr__(self, "depths", d)


class Network:
    """What the planner reads of the factory's full network, built under ``lazy_init`` (nothing materialised):
    its parameters, its optimizer's state count, the repeated list it cuts (``cut``, ``depth``: how many blocks
    the full network has; ``None`` without one) and that list's attribute name."""

    def __init__(self, ref: str, kwargs: dict = None):
        from ..core.config import MixedPrecision
        from ..core.introspect import param_infos
        from ..core.plan import PartitionPlan
        from ..engine.optim import OptimizerLayout
        from ..engine.probe import measured_model

        net, opt, lists = build(ref, kwargs=kwargs)
        self.cut = self.depth = self.list_name = None
        self.block_numel, self.block_bytes = 0, 0
        if lists.found:
            best = lists.largest()
            self.cut, self.depth, self.list_name = best["index"], best["length"], block_list_name(net, best["cells"])
            self.block_numel = best["block_numel"]
            self.block_bytes = sum(int(np.prod(p.shape)) * dtype_bytes(p.dtype)
                                   for p in best["cells"][0].get_parameters())
        layout = OptimizerLayout.read(opt)
        self.n_states = len(layout.states)
        plan = PartitionPlan.build(param_infos(net, MixedPrecision(), opt), 1, 0)
        # what this optimizer keeps per parameter and how it updates each (flat or owned whole): the estimates'
        self.model = measured_model(layout, [plan[p.name] for p in layout.params])
        self.numel = sum(int(np.prod(p.shape)) for p in net.get_parameters())
        self.net = net
        self.optimizer = opt

    def gathered_bytes(self, options: dict) -> float:
        """Bytes of one block's parameters as stage 3 gathers them (in ``param_dtype`` when given)."""
        if options.get("param_dtype"):
            return self.block_numel * dtype_bytes(options["param_dtype"])
        return self.block_bytes

    def largest(self, fit: Fit, budget: float, batch: int) -> dict:
        """The most blocks (and the parameters of that network) whose predicted peak fits ``budget``."""
        blocks = fit.largest_depth(budget, batch)
        return dict(blocks=blocks, parameters=self.numel + (blocks - self.depth) * self.block_numel)


def _sample_spec(sample, tmp: Path):
    """``(sample, arrays path or None, batch)`` from Tensors/arrays or ``(shape, dtype)`` pairs."""
    if not isinstance(sample, (list, tuple)) or not sample:
        raise ValueError(f"sample must be a non-empty list of the network's inputs (Tensors, arrays or "
                         f"(shape, dtype) pairs), got {sample!r}")
    if all(hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, tuple) for x in sample):
        arrays = [x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x) for x in sample]
        path = tmp / "sample.npz"
        np.savez(path, **{f"a{i}": a for i, a in enumerate(arrays)})
        return [dict(shape=list(a.shape), dtype=str(a.dtype)) for a in arrays], str(path), int(arrays[0].shape[0])
    out = []
    for item in sample:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (list, tuple))):
            raise ValueError(f"sample item {item!r}: expected (shape, dtype), e.g. ((8, 64), 'int32')")
        shape, dtype = tuple(int(d) for d in item[0]), str(np.dtype(str(item[1]).replace("mindspore.", "")))
        if not shape or shape[0] < 1:
            raise ValueError(f"sample item {item!r}: dimension 0 (the batch) must be >= 1")
        out.append(dict(shape=list(shape), dtype=dtype))
    return out, None, out[0]["shape"][0]


def _other_batch(batch: int) -> int:
    return batch // 2 if batch >= 2 and batch % 2 == 0 else 2 * batch


def _jsonable(options: dict) -> dict:
    """``options`` for a rehearsal: dtypes by name; ``compile_cache`` left out (a rehearsal's graph is not a
    rank's, and its memory is measured with its compile)."""
    return {k: (str(v).replace("mindspore.", "").lower() if k in ("param_dtype", "reduce_dtype") and v is not None
                else v) for k, v in options.items() if k != "compile_cache"}


class Planner:
    """Rehearsals of one factory and sample, shared by the configurations that need them."""

    def __init__(self, factory, sample, world_size: int, rehearsal: Rehearsal = None):
        require_int("world_size", world_size, 1)
        rehearsal = rehearsal or Rehearsal()
        if not isinstance(rehearsal, Rehearsal):
            raise TypeError(f"rehearsal must be a mindzero.Rehearsal, got {type(rehearsal).__name__}")
        self.ref = factory_ref(factory)
        self.factory_kwargs = dict(rehearsal.factory_kwargs or {})
        self.world_size, self.depths, self.jobs = world_size, rehearsal.depths, rehearsal.jobs
        self.timeout = rehearsal.timeout
        self.progress = rehearsal.progress or (lambda msg: None)
        self._tmp = tempfile.TemporaryDirectory(prefix="mindzero_plan_")
        self.sample, self.arrays, self.batch = _sample_spec(sample, Path(self._tmp.name))
        self.network = Network(self.ref, self.factory_kwargs)
        if self.network.depth is not None and self.network.depth < self.depths[1]:
            self.depths = (1, self.network.depth)  # a repeated list has at least 2 blocks
        self._cache = {}

    def _spec(self, options, depth, batch, recompute) -> dict:
        net = self.network
        return dict(factory=self.ref, factory_kwargs=self.factory_kwargs, world_size=self.world_size, options=_jsonable(options), sample=self.sample,
                    arrays=self.arrays, batch=batch, recompute=recompute,
                    cut=net.cut, depth=depth if net.cut is not None else None)

    def measure(self, runs) -> list:
        """Measurements of ``runs`` (``(options, depth, batch, recompute)``), rehearsed ``jobs`` at a time, cached."""
        todo = []
        for run in runs:
            key = json.dumps(self._spec(*run), sort_keys=True)
            if key not in self._cache and key not in [k for k, _ in todo]:
                todo.append((key, self._spec(*run)))
        if todo:
            self.progress(f"rehearsing {len(todo)} replica(s) as rank 0 of {self.world_size}, {self.jobs} at a time")

        def one(item):
            key, spec = item
            m = run_child(spec, self.timeout)
            self.progress(f"  {spec['options']}, {spec['depth'] or 'whole'} block(s), batch {spec['batch']}"
                          f"{', recompute' if spec['recompute'] else ''}: peak {m.peak / MIB:.0f} MiB "
                          f"({m.seconds:.0f} s)")
            return key, m

        with ThreadPoolExecutor(self.jobs) as pool:
            for key, m in pool.map(one, todo):
                self._cache[key] = m
        return [self._cache[json.dumps(self._spec(*run), sort_keys=True)] for run in runs]

    def fit(self, options: dict, recompute: bool = False, batch_from: dict = None, of: str = "peak") -> Fit:
        """The fit of one configuration: two depths at the sample's batch; the batch terms from the same
        configuration at another batch, or from ``batch_from`` (another configuration of the same precision).
        ``of``: the measured quantity fitted (``"peak"``: RSS; ``"pool"``: MindSpore's memory pool)."""
        d1, d2 = self.depths
        b, b2 = self.batch, _other_batch(self.batch)
        src = options if batch_from is None else batch_from

        def measured(opts, depths, batch):
            ms = self.measure([(opts, d, batch, recompute) for d in depths])
            kept = 0.0
            if keeps_gathers(opts) and len(ms) == 2:  # what the rehearsal kept that a run re-gathers
                plain = self.measure([({**opts, "stage3_regather": False}, d, batch, recompute) for d in depths])
                kept = kept_gathers_per_block(ms, plain, self.network.gathered_bytes(opts))
            return [replace(m, peak=getattr(m, of) - (kept * (m.depth - depths[0]) if kept else 0)) for m in ms]

        if self.network.cut is None:  # no repeated blocks: the whole network at two batches
            (m1,), (m2,), (m1_src,) = measured(options, [None], b), measured(src, [None], b2), measured(src, [None], b)
            per_sample = max(0.0, (m2.peak - m1_src.peak) / (b2 - b))
            return Fit(m1.peak - b * per_sample, 0.0, per_sample, 0.0, m1.traffic, 0.0, m1.micro_traffic, 0.0)
        lo, hi = measured(options, (d1, d2), b)
        lo2, hi2 = measured(src, (d1, d2), b2)
        src_lo, src_hi = measured(src, (d1, d2), b)
        batch_terms = with_batch_terms(fit_depth(src_lo, src_hi), b, (src_lo, src_hi), (lo2, hi2))
        own = fit_depth(lo, hi)
        return Fit(own.c0 - b * batch_terms.a0, own.c1 - b * batch_terms.a1, batch_terms.a0, batch_terms.a1,
                   own.t0, own.t1, own.u0, own.u1)

    def predict(self, options: dict, recompute: bool = False, batch: int = None, accumulation: int = None,
                batch_from: dict = None) -> Prediction:
        """The full network's prediction for ``options`` at micro-batch ``batch`` (default: the sample's)."""
        from ..core.estimate import estimate_memory

        fit = self.fit(options, recompute, batch_from)
        pool = self.fit(options, recompute, batch_from, of="pool")
        batch = self.batch if batch is None else batch
        accumulation = accumulation or int(options.get("gradient_accumulation_steps", 1) or 1)
        depth = self.network.depth if self.network.cut is not None else 0
        stage = int(options.get("zero_stage", 0))
        est = estimate_memory(self.network.net, stage, self.world_size, self.network.model,
                              **{**{k: v for k, v in options.items() if k != "zero_stage"},
                                 "gradient_accumulation_steps": accumulation})
        peak = fit.peak(depth, batch)
        if accumulation > 1 and int(options.get("gradient_accumulation_steps", 1) or 1) == 1:
            peak += est["gradients"]  # calibrated without accumulation: add the gradient buffers it allocates
        states = est["total"]
        grad_item = 2 if (options.get("param_dtype") or options.get("reduce_dtype")) else 4
        full_grads = est["phi"] * grad_item
        transient = transient_bytes(full_grads, stage, self.network.block_bytes,
                                    options.get("stage3_regather", True))
        acts = fit.activations(depth, batch)
        parts = dict(model_states=states, transient=transient, activations=acts,
                     framework=peak - states - transient - acts)
        opts = {**options, **({"recompute": True} if recompute else {})}
        return Prediction(opts, self.world_size, self.network.depth, batch, accumulation, peak, parts,
                          fit.traffic(depth, accumulation), fit, pool=pool.peak(depth, batch))

    def close(self):
        import gc

        self._tmp.cleanup()
        self.network.net = self.network.optimizer = None  # MindSpore's Cells complain when collected at exit
        gc.collect()


def predict_peak(factory, sample, world_size: int, zero_stage: int = 0, *, recompute: bool = False,
                 rehearsal: Rehearsal = None, **options) -> Prediction:
    """Predict each rank's peak RSS above the process's RSS before building the network, before launching.

    Args:
        factory: a top-level function (or ``"module:function"``) returning ``(net_with_loss, optimizer)``, the
            optimizer built from the network's parameters; the planner builds it under ``lazy_init``. A factory
            defined in the running script is found by importing that script in each rehearsal process, so the
            script must keep its work under ``if __name__ == "__main__":`` (or it is refused, naming the line).
        sample: the network's inputs for one micro-batch on one rank: Tensors/arrays, or ``(shape, dtype)``
            pairs (integers filled with 0, floats random); dimension 0 is the batch.
        world_size: ranks of the launch (the op group: hybrid layouts are not predicted).
        zero_stage, **options: ``prepare_train_network``'s arguments (as strings or numbers: ``param_dtype=
            "float16"``), validated as ``prepare_train_network`` validates them before anything is rehearsed.
        recompute: recompute each repeated block in backward (``Cell.recompute()``).
        rehearsal: how to rehearse (:class:`Rehearsal`: the replicas' depths, processes at once, timeout,
            progress lines, the factory's keyword arguments).

    Returns:
        :class:`mindzero.core.fit.Prediction`: ``peak`` (bytes), ``parts`` (model states by the plan,
        transient by the formulas, activations, framework and compiled graph: the rest), ``wire_bytes`` (ring
        bytes per step per rank on GPU/Ascend), ``fit`` and ``measurements``.

    Raises:
        ValueError / TypeError: a factory that is not importable by name, a bad sample or option (named).
        RuntimeError: a rehearsal that failed (with its error) or timed out.
    """
    options = {"zero_stage": zero_stage, **options}
    ZeroConfig.from_arguments(options)  # the options' errors before any rehearsal, as prepare_train_network's
    planner = Planner(factory, sample, world_size, rehearsal)
    try:
        return planner.predict(options, recompute)
    finally:
        planner.close()


def candidates(stages=(0, 1, 2, 3), param_dtype=None, units_pattern=None, quantization=True, regather=True) -> list:
    """The configurations ``plan`` weighs: each stage, and at stage 3 per-block gathers (``units_pattern``),
    int8 gathers and no backward re-gather; each with ``param_dtype`` when given."""
    out = []
    for dtype in ([None] + ([param_dtype] if param_dtype else [])):
        base = {"param_dtype": dtype} if dtype else {}
        for s in stages:
            out.append({"zero_stage": s, **base})
        if 3 in stages:
            if units_pattern:
                out.append({"zero_stage": 3, **base, "gather_units": units_pattern})
            if quantization:
                out.append({"zero_stage": 3, **base, "gather_quantization": "int8"})
            if regather:
                out.append({"zero_stage": 3, **base, "stage3_regather": False})
    return out


def plan(factory, sample, world_size: int, budget, *, margin: float = DEFAULT_MARGIN, rehearsal: Rehearsal = None,
         **search) -> dict:
    """The configurations that fit ``budget`` (bytes per rank above the RSS before building, or ``"5GiB"``), and
    the one to use: the fewest bytes on the wire among those that fit.

    ``search`` (:data:`SEARCH_KEYS`): ``stages`` (default 0-3; at stage 3 also per-block gathers, int8 gathers and
    no re-gather), ``param_dtype`` (also weigh it, when given), ``recompute`` (also weigh recomputing the repeated
    blocks), ``global_batch`` (samples per rank per optimizer step: weigh gradient accumulation over equal
    micro-batches, predicted from the batch terms of the fit, no more rehearsals), ``quantization`` (default True:
    weigh int8 gathers). A configuration fits when its prediction times ``1 + margin`` is within the budget
    (default 10%: above the largest error against real launches, docs/performance.md). ``rehearsal``: as
    :func:`predict_peak`'s.

    Returns:
        ``{"predictions": [Prediction], "best": Prediction, "reason": str, "table": str, "largest_depth": {label:
        blocks}, "network": {...}}``.

    Raises:
        ValueError: nothing fits (naming the smallest peak found), or bad arguments.
    """
    unknown = sorted(set(search) - set(SEARCH_KEYS))
    if unknown:
        raise ValueError(f"plan: unknown argument {unknown[0]!r}; what plan weighs is {list(SEARCH_KEYS)}")
    stages = tuple(search.get("stages", (0, 1, 2, 3)))
    param_dtype, recompute = search.get("param_dtype"), bool(search.get("recompute", False))
    global_batch, quantization = search.get("global_batch"), search.get("quantization", True)
    for stage in stages:
        ZeroConfig.from_arguments({"zero_stage": stage, "param_dtype": param_dtype})
    budget = parse_bytes(budget)
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r}: must be a fraction in [0, 1), e.g. 0.1 for 10%")
    usable = budget / (1 + margin)  # what a prediction may reach
    planner = Planner(factory, sample, world_size, rehearsal)
    try:
        net = planner.network
        units = f"{net.list_name}.*" if net.list_name else None
        configs = candidates(stages, param_dtype, units, quantization)
        variants = [False, True] if recompute else [False]
        # one batch-term source per precision and recompute: stage 0 of that precision
        runs = []
        for rc in variants:
            for opts in configs:
                runs += [(opts, d, planner.batch, rc) for d in planner.depths]
            for dtype in {o.get("param_dtype") for o in configs}:
                src = {"zero_stage": 0, **({"param_dtype": dtype} if dtype else {})}
                runs += [(src, d, _other_batch(planner.batch), rc) for d in planner.depths]
        if net.cut is None:
            runs = [(o, None, b, rc) for (o, _, b, rc) in runs]
        planner.measure(runs)  # all at once: `jobs` in parallel
        preds = []
        for rc in variants:
            for opts in configs:
                src = {"zero_stage": 0, **({"param_dtype": opts["param_dtype"]} if opts.get("param_dtype") else {})}
                choices = accumulation_choices(global_batch) if global_batch else [(1, planner.batch)]
                for k, micro in choices:
                    preds.append(planner.predict(opts, rc, micro, k, batch_from=src))
        try:
            best, reason = recommend(preds, usable)
        except ValueError as err:
            raise ValueError(f"{err} (the budget less the {margin:.0%} margin)\n{table(preds, usable)}") from None
        return dict(predictions=preds, best=best, reason=reason, table=table(preds, usable), budget=budget,
                    usable=usable, margin=margin,
                    network=dict(factory=planner.ref, blocks=net.depth, block_list=net.list_name,
                                 block_parameters=net.block_numel, world_size=world_size, batch=planner.batch,
                                 sample=planner.sample, optimizer=optimizer_summary(net, world_size)),
                    largest_depth={p.label: net.largest(p.fit, usable, p.batch) for p in preds
                                   if net.cut is not None and p.accumulation == 1})
    finally:
        planner.close()


def optimizer_summary(net: Network, world_size: int) -> dict:
    """How the factory's optimizer shares its update out over ``world_size`` ranks at stages 1-3: its name, the
    parameters sharded flat and owned whole, and (owner mode) the most loaded rank's optimizer states against the
    even share."""
    from ..core.estimate import estimate_memory

    est = estimate_memory(net.net, 1, world_size, net.model)
    owned = est["owner_mode"]
    return dict(name=net.model.label, flat=len(net.model.by_name) - owned, owner=owned, balance=est["balance"])

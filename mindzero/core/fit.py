"""Will it fit? The arithmetic of :func:`mindzero.predict_peak` and ``mindzero-plan`` (pure Python).

A rank's peak RSS above the RSS before the network is built is the model states the partition plan
allocates (exact: :func:`mindzero.core.memory.expected_bytes`) plus what no formula knows: the compiled
graph and the framework's buffers, the activations, the transient gathers and reductions. The planner
learns that part from small *replicas* of the network, rehearsed in one process as rank 0 of ``N``
(:func:`mindzero.comm.groups.rehearse`: the real graph, the collectives local operations of their shapes):
the network with ``d`` of its repeated blocks, at micro-batch ``b``, for two depths and two batches. Its model:

    peak(d, b) = c0 + c1 * d + b * (a0 + a1 * d)

bilinear in the depth and the batch: every block adds the same parameters, states, graph and activations; every
sample the same activations. Four measurements fix the four numbers (:func:`fit_bilinear`); a configuration
calibrated at one batch only takes its batch terms from another of the same precision (:func:`with_batch_terms`).
The parts of a prediction are attribution, the total is the fit: model states by the plan, transient by the
formulas (:func:`transient_bytes`), activations ``b * (a0 + a1 * L)``, framework and compiled graph the rest.

Limits (docs/performance.md, "Will it fit?"): growth that is not linear in depth (a graph the compiler fuses
differently at depth), a network without repeated blocks (then the whole network is rehearsed: no
extrapolation), the batch in dimension 0 of every input, and the launcher's own processes (not a rank's).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

MIB = 2 ** 20
GIB = 2 ** 30


@dataclass(frozen=True)
class Measurement:
    """One rehearsed replica: ``depth`` repeated blocks, micro-batch ``batch``; ``peak``: bytes of peak RSS above
    the RSS before building; ``states``: the model-state bytes it allocated (``memory_report``); ``traffic``: ring
    bytes per step per rank of the real collectives (GPU/Ascend: ``zero_info.real_calls``); ``seconds``: the
    whole rehearsal (build, prepare, two steps)."""

    depth: int
    batch: int
    peak: int
    states: int = 0
    traffic: float = 0.0
    seconds: float = 0.0
    micro_traffic: float = 0.0  # the part of ``traffic`` every micro-step repeats (forward and backward)
    pool: int = 0  # peak bytes of MindSpore's memory pool (the device memory on GPU/Ascend; MiB resolution)


@dataclass(frozen=True)
class Fit:
    """``peak(d, b) = c0 + c1 d + b (a0 + a1 d)`` bytes; ``traffic(d) = t0 + t1 d`` ring bytes per step, of which
    ``u0 + u1 d`` every micro-step repeats."""

    c0: float
    c1: float
    a0: float
    a1: float
    t0: float = 0.0
    t1: float = 0.0
    u0: float = 0.0
    u1: float = 0.0

    def peak(self, depth: float, batch: float) -> float:
        return self.c0 + self.c1 * depth + batch * (self.a0 + self.a1 * depth)

    def activations(self, depth: float, batch: float) -> float:
        return batch * (self.a0 + self.a1 * depth)

    def traffic(self, depth: float, accumulation: int = 1) -> float:
        """Ring bytes per optimizer step: the micro-step's collectives ``accumulation`` times, the rest once."""
        return self.t0 + self.t1 * depth + (accumulation - 1) * (self.u0 + self.u1 * depth)

    def largest_depth(self, budget: float, batch: float) -> int:
        """The most blocks whose predicted peak is at most ``budget`` (0 if not even one)."""
        per_block = self.c1 + batch * self.a1
        base = self.c0 + batch * self.a0
        if per_block <= 0:
            raise ValueError("the fit grows by nothing per block: no largest depth")
        return max(0, int((budget - base) // per_block))


def _line(x0, y0, x1, y1):
    """``(intercept, slope)`` of the line through two points."""
    if x0 == x1:
        raise ValueError(f"two measurements at the same point ({x0}) fix no slope")
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


def fit_depth(a: Measurement, b: Measurement) -> Fit:
    """The fit of two depths at one batch, with no batch terms (:func:`with_batch_terms` adds them)."""
    if a.batch != b.batch:
        raise ValueError(f"fit_depth: measurements at batches {a.batch} and {b.batch}; need one batch")
    c0, c1 = _line(a.depth, a.peak, b.depth, b.peak)
    t0, t1 = _line(a.depth, a.traffic, b.depth, b.traffic)
    u0, u1 = _line(a.depth, a.micro_traffic, b.depth, b.micro_traffic)
    # the batch terms are zero: peak(d, b) = c0 + c1 d at this batch, and c0, c1 include its activations
    return Fit(c0, c1, 0.0, 0.0, t0, t1, u0, u1)


def fit_bilinear(measurements) -> tuple:
    """``(fit, batch)``: the fit of four measurements, two depths at each of two batches, and the batch the
    depth terms were measured at (the first measurement's)."""
    ms = list(measurements)
    depths, batches = sorted({m.depth for m in ms}), sorted({m.batch for m in ms})
    if len(depths) != 2 or len(batches) != 2 or len(ms) != 4:
        raise ValueError(f"fit_bilinear: need two depths at each of two batches, got {[(m.depth, m.batch) for m in ms]}")
    at = {(m.depth, m.batch): m for m in ms}
    base = ms[0].batch
    other = batches[1] if base == batches[0] else batches[0]
    lo, hi = depths
    depth_fit = fit_depth(at[(lo, base)], at[(hi, base)])
    return with_batch_terms(depth_fit, base, (at[(lo, base)], at[(hi, base)]), (at[(lo, other)], at[(hi, other)])), base


def with_batch_terms(fit: Fit, base: int, at_base, at_other) -> Fit:
    """``fit`` (measured at batch ``base``) with the activation terms of another pair of measurements: two depths at
    ``base`` and the same two at another batch, possibly of another configuration of the same precision (the
    activations do not depend on the stage). The depth terms are re-expressed so ``fit`` is unchanged at ``base``."""
    (lo, hi), (lo2, hi2) = at_base, at_other
    if (lo.depth, hi.depth) != (lo2.depth, hi2.depth) or lo2.batch != hi2.batch or lo2.batch == base:
        raise ValueError("with_batch_terms: need the same two depths at the base batch and at another batch")
    db = lo2.batch - base
    # activations grow with the batch; a negative slope is measurement noise (a small network): none
    per_sample_lo, per_sample_hi = max(0.0, (lo2.peak - lo.peak) / db), max(0.0, (hi2.peak - hi.peak) / db)
    a0, a1 = _line(lo.depth, per_sample_lo, hi.depth, per_sample_hi)
    return replace(fit, c0=fit.c0 - base * a0, c1=fit.c1 - base * a1, a0=a0, a1=a1)


@dataclass
class Prediction:
    """A configuration's predicted per-rank peak (bytes above the RSS before building) and its parts."""

    options: dict  # prepare_train_network's keyword arguments (zero_stage included)
    world_size: int
    depth: int  # repeated blocks of the full network (None: no repeated blocks found; rehearsed whole)
    batch: int  # micro-batch per rank
    accumulation: int  # gradient_accumulation_steps
    peak: float
    parts: dict  # model_states, transient, activations, framework (bytes; they sum to peak)
    wire_bytes: float  # ring bytes per step per rank of the real collectives (GPU/Ascend)
    fit: Fit = None
    pool: float = 0.0  # MindSpore's memory pool peak, by the same fit (what a device would hold; see docs)
    measurements: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return config_label(self.options, self.accumulation)

    def as_dict(self) -> dict:
        return dict(label=self.label, options=self.options, world_size=self.world_size, depth=self.depth,
                    batch=self.batch, accumulation=self.accumulation, peak=self.peak, parts=self.parts,
                    wire_bytes=self.wire_bytes, pool=self.pool, fit=None if self.fit is None else vars(self.fit),
                    measurements=[vars(m) for m in self.measurements])


def config_label(options: dict, accumulation: int = 1) -> str:
    """A short name: ``stage 3, fp16 params, int8 gathers, units, no regather, recompute, accumulate 4``."""
    out = [f"stage {options.get('zero_stage', 0)}"]
    if options.get("param_dtype"):
        out.append(f"{options['param_dtype']} params")
    if options.get("gather_quantization"):
        out.append(f"{options['gather_quantization']} gathers")
    if options.get("gather_units"):
        out.append("a gather per block")
    if options.get("stage3_regather") is False:
        out.append("no regather")
    if options.get("recompute"):
        out.append("recompute")
    if accumulation > 1:
        out.append(f"accumulate {accumulation}")
    return ", ".join(out)


def keeps_gathers(options: dict) -> bool:
    """Whether a rehearsal of ``options`` may hold what a run re-gathers: stage 3's exact per-parameter gathers
    with ``stage3_regather`` (the default). A run recomputes each gather in backward, where the collective's
    ordering places it, and frees the forward's full parameters. The rehearsal's local stand-in is recomputed
    too, but on some graphs it runs early, so its memory pool keeps the gathered parameters from forward to
    backward (on others, mindcv's ViT among them, it re-gathers as a run does). :func:`kept_gathers_per_block`
    measures it."""
    return (int(options.get("zero_stage", 0)) == 3 and options.get("stage3_regather", True) is not False
            and not options.get("gather_units") and not options.get("gather_quantization"))


def kept_gathers_per_block(regather, plain, block_bytes: float) -> float:
    """Bytes per block a rehearsal kept that a run re-gathers: ``block_bytes`` (a block's gathered parameters)
    less what re-gathering saved in the rehearsal's memory pool, the per-block growth of its pool without
    re-gather (``plain``: two depths) less with it (``regather``: the same two depths); between 0 and
    ``block_bytes``."""
    (lo, hi), (plo, phi) = regather, plain
    if (lo.depth, hi.depth) != (plo.depth, phi.depth) or lo.depth == hi.depth:
        raise ValueError("kept_gathers_per_block: need the same two depths with and without re-gather")
    saved = ((phi.pool - plo.pool) - (hi.pool - lo.pool)) / (hi.depth - lo.depth)
    return min(max(block_bytes - saved, 0.0), block_bytes)


def transient_bytes(full_gradient_bytes: int, stage: int, block_bytes: int, regather: bool = True) -> int:
    """What a step holds beyond the persistent states, by the formulas: the gradients of one step (stage 0: every
    full gradient at once; stages 1-3, compiled depth-first: each reduced, or added into its accumulation buffer,
    where backward produces it, so about one block's), and at stage 3 one block's gathered parameters in forward
    and (regather) again in backward."""
    if stage == 0:
        return full_gradient_bytes
    grads = block_bytes
    gathered = block_bytes * (2 if regather else 1) if stage == 3 else 0
    return grads + gathered


def recommend(predictions, budget: float):
    """``(best, reason)``: among the predictions that fit ``budget`` (bytes), the one with the fewest wire bytes
    per step; ties go to fewer micro-steps, then the lower stage (stage 3 with the same traffic puts its gathers
    on the forward's critical path), then the lower peak.

    Raises:
        ValueError: nothing fits; the message names the smallest predicted peak and its configuration.
    """
    preds = list(predictions)
    if not preds:
        raise ValueError("no configuration to choose from")
    fits = [p for p in preds if p.peak <= budget]
    if not fits:
        low = min(preds, key=lambda p: p.peak)
        raise ValueError(f"budget={budget / GIB:.2f} GiB per rank: no configuration fits; the smallest predicted "
                         f"peak is {low.peak / GIB:.2f} GiB ({low.label})")
    best = min(fits, key=lambda p: (round(p.wire_bytes), p.accumulation, p.options.get("zero_stage", 0), p.peak))
    cheaper = [p for p in preds if p.wire_bytes < best.wire_bytes]
    why = (f"fits {best.peak / GIB:.2f} GiB of {budget / GIB:.2f} GiB with the fewest bytes on the wire "
           f"({best.wire_bytes / MIB:.0f} MiB per step)")
    if cheaper:
        c = min(cheaper, key=lambda p: p.peak)  # of those that send less, the nearest to fitting
        why += f"; {c.label} sends less ({c.wire_bytes / MIB:.0f} MiB) but needs {c.peak / GIB:.2f} GiB"
    return best, why


def table(predictions, budget: float = None) -> str:
    """The markdown table of predictions (MiB), with a fit column when ``budget`` is given."""
    head = "| configuration | peak MiB | model states | transient | activations | framework + graph | wire MiB/step |"
    rule = "|---|---|---|---|---|---|---|"
    if budget is not None:
        head += " fits |"
        rule += "---|"
    lines = [head, rule]
    for p in predictions:
        parts = [p.parts.get(k, 0) / MIB for k in ("model_states", "transient", "activations", "framework")]
        row = (f"| {p.label} | {p.peak / MIB:.0f} | " + " | ".join(f"{x:.0f}" for x in parts) +
               f" | {p.wire_bytes / MIB:.0f} |")
        if budget is not None:
            row += " yes |" if p.peak <= budget else " no |"
        lines.append(row)
    return "\n".join(lines)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.I)


def parse_bytes(text, name: str = "budget") -> int:
    """``"22GiB"``, ``"5.5G"``, ``"800MiB"``, ``"1e9"`` or an int -> bytes (k/m/g/t: powers of 1024 with or
    without ``i``, as memory is counted).

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            try:
                value = float(str(text))
            except ValueError:
                raise ValueError(f"{name}={text!r}: expected a size such as 22GiB, 800MiB or a number of bytes") \
                    from None
        else:
            value = float(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower())
    if value <= 0:
        raise ValueError(f"{name}={text!r}: must be above 0 bytes")
    return int(value)


def accumulation_choices(global_batch: int, max_steps: int = 16) -> list:
    """``(steps, micro)`` pairs: gradient accumulation steps (at most ``max_steps``) that split ``global_batch``
    samples per rank into equal micro-batches, fewest steps first."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: must be an int >= 1 (samples per rank per optimizer step)")
    return [(k, global_batch // k) for k in range(1, min(global_batch, max_steps) + 1) if global_batch % k == 0]

"""Per-rank memory before step 1: ``estimate_memory`` and the ``mindzero-estimate`` tool (pure Python).

The estimate is the partition plan's arithmetic (:func:`mindzero.core.memory.expected_bytes`) on the
parameter shapes, so it counts padding and replicated parameters exactly as ``prepare_train_network``
will; ``memory_report(train_net)`` is the measured side. Beside it, the ZeRO paper's formulas for
``Φ`` parameters on ``N`` ranks (arXiv 1910.02054, K = 12 for mixed-precision Adam):

=====  ====================  ======================================================
stage  paper (fp16 + fp32     mindzero without ``param_dtype`` (parameters trained in
       master, Adam)          fp32, Adam, gradient accumulation buffers)
=====  ====================  ======================================================
0      2Φ + 2Φ + 12Φ = 16Φ    4Φ + 4Φ + 8Φ = 16Φ
1      4Φ + 12Φ/N             8Φ + 12Φ/N  (moments 8Φ/N + master shard 4Φ/N beside the user's parameter)
2      2Φ + 14Φ/N             4Φ + 16Φ/N  (moments 8Φ/N + master shard 4Φ/N)
3      16Φ/N                  16Φ/N
=====  ====================  ======================================================

With ``param_dtype=float16`` (``--mixed-precision`` on the command
line) mindzero allocates the paper's column exactly (fp16 parameters and gradient buffers, fp32
masters and moments), plus padding.

Without accumulation the gradients exist only inside the step (not counted as persistent).

An optimizer that is not element-wise (``lamb``, ``adafactor``, ``came``, ``muon``'s matrices) keeps each
sharded parameter's states whole on one owner rank (:mod:`mindzero.core.optim_plan`): the estimate is the most
loaded rank's, and ``balance`` says how far it is from the total over the ranks.

``python -m mindzero.core.estimate --params 100M --op-sizes 2,4,8`` (console script ``mindzero-estimate``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from .config import MixedPrecision, ZeroConfig, stage_policy
from .memory import KINDS, expected_bytes
from .offload import DEFAULT_CHUNK_MB, SPLITTABLE_MODELS
from .optim_plan import (OPTIMIZER_MODELS, OWNER, MeasuredModel, OptimizerModel, balance, every_rank_bytes,
                         planned_updates)
from .checks import is_int, require_int
from .introspect import param_infos
from .options import ARGUMENT_DEFAULTS
from .plan import ParamInfo, PartitionPlan

def paper_formula(phi: int, stage: int, op_size: int, mixed_precision: bool = True, n_states: int = 2) -> dict:
    """The ZeRO paper's per-rank bytes by kind for ``phi`` parameters (mixed precision: fp16 parameters
    and gradients, fp32 master copy and ``n_states`` fp32 moments: K = 4 + 4 * n_states); with
    ``mixed_precision=False`` the fp32 version mindzero allocates (see the module table)."""
    n, policy = op_size, stage_policy(stage)
    part = lambda nbytes, sharded: nbytes / n if sharded else nbytes  # noqa: E731
    if mixed_precision:
        k = 4 + 4 * n_states
        return {"parameters": part(2 * phi, policy.shard_parameters),
                "gradients": part(2 * phi, policy.shard_gradients),
                "optimizer_states": part(k * phi, policy.shard_optimizer_states)}
    # fp32: stages 1-2 keep a master shard beside the user's full parameter
    master = 4 * phi if policy.shard_optimizer_states and not policy.shard_parameters else 0
    return {"parameters": part(4 * phi, policy.shard_parameters),
            "gradients": part(4 * phi, policy.shard_gradients),
            "optimizer_states": part(4 * n_states * phi + master, policy.shard_optimizer_states)}


def _param_infos(network_or_param_shapes, precision: MixedPrecision):
    if hasattr(network_or_param_shapes, "get_parameters"):  # a MindSpore Cell
        return param_infos(network_or_param_shapes, precision)
    if isinstance(network_or_param_shapes, dict):
        items = list(network_or_param_shapes.items())
    else:
        items = [(f"param_{i}", s) for i, s in enumerate(network_or_param_shapes)]
    out = []
    for name, shape in items:
        shape = (shape,) if is_int(shape) else tuple(shape)
        if any(not is_int(d) or d < 0 for d in shape):
            raise ValueError(f"network_or_param_shapes: {name!r} has shape {shape!r}; dimensions must be ints >= 0")
        out.append(ParamInfo(name, shape, precision.held("float32", True)))
    return out


def estimate_memory(network_or_param_shapes, zero_stage: int, op_size: int, optimizer: str = "adamw", *,
                    n_states: int = None, **options) -> dict:
    """Bytes per rank by kind that ``prepare_train_network`` will allocate, and the paper's formula.

    Args:
        network_or_param_shapes: a Cell (its parameters, dtypes and opt-outs), a ``{name: shape}``
            dict or a list of shapes (dtype float32).
        zero_stage: 0-3. op_size: ranks the state is sharded over (the op group).
        optimizer: a name of :data:`mindzero.core.optim_plan.OPTIMIZER_MODELS` (what it keeps per parameter,
            and whether it is element-wise: ``adamw``, ``sgd`` (MindSpore's keeps two states), ``came``,
            ``adafactor``, ``muon``, ``mint.adam``, ...), or such a model (an ``OptimizerModel``, or a
            ``MeasuredModel`` read from a real optimizer: ``mindzero-plan``).
        **options: ``prepare_train_network``'s options, by its names and validated as it validates them (an
            unknown name, a bad value or a missing companion is the same error): those that change the bytes are
            ``gradient_accumulation_steps`` (above 1: the persistent gradient buffers are counted),
            ``param_dtype`` / ``reduce_dtype`` (fp32 masters and moments), ``gather_quantization`` (adds
            ``quantization_buffers``: the int8 payloads of this rank's shards kept from forward to backward;
            transient, not in ``total``), ``stage3_param_persistence_threshold`` /
            ``stage3_model_persistence_threshold`` (parameters kept whole on every rank at stage 3), and
            ``optimizer_offload="disk"`` with its ``offload_dir`` and ``offload_chunk_mb`` (the moments counted on
            disk: ``optimizer_disk``, ``disk_io_per_step`` = read + written per update, and the stream's resident
            ``offload_buffers`` (in ``total``) and gradient buffers (in ``gradients``)).
        n_states: the optimizer's state tensors per parameter, when known from the optimizer itself (overrides
            ``optimizer``: that many element states, element-wise).

    Returns:
        ``{"parameters", "gradients", "optimizer_states", "total": int, "phi": int,
        "formula": {kind: float, "total": float}, "formulas": {"fp32": {...}, "mixed_precision": {...}}, ...}``
        (also ``optimizer_moments``, ``master_shards``) of the most loaded rank (``per_rank``: every op rank's
        total; ``balance``: the most loaded rank's optimizer states over the total over the ranks, 1.0 when even;
        ``owner_mode``: parameters updated whole on an owner rank): ``formula`` is the one of this precision,
        ``formulas`` both side by side.

    Raises:
        ValueError: a bad stage, group size, optimizer or shape (the message names it).
    """
    require_int("op_size (ranks the state is sharded over)", op_size, 1)
    if isinstance(optimizer, (OptimizerModel, MeasuredModel)):
        key, model = "", optimizer
    else:
        key = str(optimizer).lower()
        if key not in OPTIMIZER_MODELS:
            raise ValueError(f"optimizer={optimizer!r}: must be one of {sorted(OPTIMIZER_MODELS)}")
        model = OPTIMIZER_MODELS[key]
    if n_states is not None:
        model = OptimizerModel(require_int("n_states", n_states, 0))
    config = ZeroConfig.from_arguments({**options, "zero_stage": zero_stage})
    policy, precision = config.policy, config.precision
    infos = _param_infos(network_or_param_shapes, precision)
    plan = PartitionPlan.build(infos, op_size, 0, persistence=config.persistence)
    optimized = [s for s in plan if s.optimized]
    keeps_master = precision.enabled or policy.shard_parameters
    updates = planned_updates(optimized, model, policy.shard_optimizer_states, op_size,
                              lambda s: s.numel * (4 if precision.enabled else s.itemsize) if keeps_master else 0,
                              config.update_sharding)
    by_name = {s.name: u for s, u in zip(optimized, updates)}
    split = key in SPLITTABLE_MODELS or getattr(model, "splittable", False)  # disk offload cuts into pieces
    ranks = [expected_bytes(plan, config, by_name, r, split_pieces=split) for r in range(op_size)]
    for r in ranks:
        r["total"] = sum(r[k] for k in KINDS) + r.get("offload_buffers", 0)
    out = max(ranks, key=lambda r: r["total"])  # the most loaded rank (owner mode: ranks differ)
    out["per_rank"] = [r["total"] for r in ranks]
    out["balance"] = balance(updates, [every_rank_bytes(s, u) for s, u in zip(optimized, updates)], op_size).ratio
    out["owner_mode"] = sum(u.mode == OWNER for u in updates)
    phi = sum(math.prod(i.shape) for i in infos if i.optimized)
    formulas = both_formulas(phi, zero_stage, op_size, model.element)
    formula = formulas["mixed_precision" if precision.enabled else "fp32"]
    out.update(phi=phi, formula=formula, formulas=formulas, stage=zero_stage, op_size=op_size)
    return out


def both_formulas(phi: int, stage: int, op_size: int, n_states: int = 2) -> dict:
    """The fp32 and the mixed-precision formula side by side (:func:`paper_formula`), each with its ``total``:
    ``{"fp32": {...}, "mixed_precision": {...}}``."""
    out = {}
    for key, mixed in (("fp32", False), ("mixed_precision", True)):
        f = paper_formula(phi, stage, op_size, mixed, n_states)
        out[key] = {**f, "total": sum(f.values())}
    return out


def _count(text: str) -> int:
    units = {"k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "g": 10 ** 9}
    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--params {text!r}: expected a count such as 125000000 or 125M") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mindzero-estimate", description="Per-rank memory of ZeRO stages 0-3 "
                                 "(plan arithmetic, padding included) next to the ZeRO paper's formulas.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_count, help="number of parameters (one flat tensor), e.g. 125M")
    src.add_argument("--shapes", help="JSON file {name: shape} of the model's parameters")
    ap.add_argument("--op-sizes", default="2,4,8", help="comma-separated op group sizes")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_MODELS))
    ap.add_argument("--mixed-precision", action="store_true", help="param_dtype=float16: fp16 parameters and gradients, fp32 masters "
                    "and moments (the paper's mixed-precision setting)")
    ap.add_argument("--no-accumulation", action="store_true", help="gradient_accumulation_steps=1: no persistent "
                    "gradient buffers (by default they are counted, as any gradient_accumulation_steps > 1 keeps them)")
    ap.add_argument("--persistence-threshold", type=int, metavar="ELEMENTS",
                    default=ARGUMENT_DEFAULTS["stage3_param_persistence_threshold"],
                    help="stage 3: parameters of fewer elements kept whole (stage3_param_persistence_threshold; "
                    "default %(default)s, 0: shard every parameter)")
    ap.add_argument("--model-persistence-threshold", type=int, metavar="ELEMENTS",
                    help="stage 3: the most elements kept whole in all (stage3_model_persistence_threshold; "
                    "default: 1%% of the model's elements)")
    ap.add_argument("--offload-dir", metavar="DIR", help="optimizer_offload='disk' with this offload_dir (stages 1-3): "
                    "the moments on disk (columns: on disk, read + written per update, the stream's slots)")
    ap.add_argument("--offload-chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                    help="offload_chunk_mb (with --offload-dir)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    a = ap.parse_args(argv)
    shapes = [a.params] if a.params is not None else json.loads(open(a.shapes).read())
    rows = []
    disk_head = " on disk MiB | disk I/O per update MiB | slots MiB |" if a.offload_dir else ""
    print("| stage | N | params MiB | grads MiB | optimizer MiB | total MiB | formula MiB | formula | other precision's "
          "formula MiB |" + disk_head)
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * (3 if a.offload_dir else 0))
    names = {0: "16Φ", 1: "4Φ+12Φ/N", 2: "2Φ+14Φ/N", 3: "16Φ/N"} if a.mixed_precision else \
        {0: "16Φ", 1: "8Φ+12Φ/N", 2: "4Φ+16Φ/N", 3: "16Φ/N"}
    mib = 2 ** 20
    for n in (int(x) for x in a.op_sizes.split(",")):
        for stage in (int(x) for x in a.stages.split(",")):
            disk = a.offload_dir is not None and stage > 0
            options = dict(gradient_accumulation_steps=1 if a.no_accumulation else 2,
                           param_dtype="float16" if a.mixed_precision else None,
                           stage3_param_persistence_threshold=a.persistence_threshold,
                           stage3_model_persistence_threshold=a.model_persistence_threshold)
            if disk:
                options.update(optimizer_offload="disk", offload_dir=a.offload_dir,
                               offload_chunk_mb=a.offload_chunk_mb)
            e = estimate_memory(shapes, stage, n, a.optimizer, **options)
            extra = ("optimizer_disk", "disk_io_per_step", "offload_buffers") if disk else ()
            rows.append({k: e[k] for k in ("stage", "op_size", "phi", "total", *KINDS, *extra)}
                        | {"formula": e["formula"]})
            print(f"| {stage} | {n} | {e['parameters'] / mib:.1f} | {e['gradients'] / mib:.1f} | "
                  f"{e['optimizer_states'] / mib:.1f} | {e['total'] / mib:.1f} | {e['formula']['total'] / mib:.1f} | "
                  f"{names.get(stage, '')} | "
                  f"{e['formulas']['fp32' if a.mixed_precision else 'mixed_precision']['total'] / mib:.1f} |"
                  + ("".join(f" {e.get(k, 0) / mib:.1f} |" for k in ("optimizer_disk", "disk_io_per_step",
                                                                      "offload_buffers")) if a.offload_dir else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The multi-rank scenarios as typed records. A :class:`Scenario`'s ``settings`` is a real mindzero settings
mapping (the keys of ``prepare_train_network``), validated by mindzero's own parser when the record is made:
a misspelt key or a bad value fails there, not in a worker."""
import dataclasses
import json
from dataclasses import dataclass, field

from mindzero.core.settings import check_settings

from .models import DEFAULT_OPTIMIZER, MODELS, OPTIMIZERS, PARITY_MODELS, trainable_bytes

STEPS = 10
DYNAMIC = {"init_loss_scale": 4096.0, "scale_factor": 2.0, "scale_window": 50}  # a dynamic loss scale of 2^12
CLIP = {"clip_grad": True, "clip_norm": 0.05}
EMA = {"ema": 0.99, "updates": 500}
FP16 = {"param_dtype": "float16", "scale_sense": DYNAMIC}
# the optimizer states on disk (the worker gives each run its own directory in place of "per-run")
DISK = {"optimizer_offload": "disk", "offload_dir": "per-run"}
DEFAULT, FULL = "default", "full"  # the tiers (tests/support/tier.py)
TIERS = (DEFAULT, FULL)


@dataclass(frozen=True)
class Scenario:
    """One training run of a launch: ``model`` trained with ``optimizer`` on the test data
    (:func:`tests.support.data.batch`) for ``steps`` steps, by plain data parallel (``stage="dp"``:
    MindSpore's ``nn.TrainOneStepCell``; with ``gradient_accumulation_steps`` K in ``settings``, on the K
    micro-batches concatenated) or by mindzero at ``stage`` with ``settings``.

    ``force_overflow``: the last rank's input holds inf at step 4 (its loss there is inf: comparisons say so).
    ``substitute``: the GPU/Ascend code path with CPU-legal primitives
    (:func:`mindzero.comm.substitute_collectives`). ``tier``: ``"default"``, or ``"full"``: a row the default
    suite leaves to the full tier (a sibling row of the default suite runs the same code path).
    ``reference``: the scenario it must equal, where one is named by the row itself. ``mode``: MindSpore's
    execution mode of the run, ``"graph"`` or ``"pynative"`` (the same train step, forward and backward op by op).
    With ``param_dtype`` in ``settings`` the network computes in fp16, converted as ``amp`` says: ``"O2"``: by the
    test, wholly (``mindspore.amp.auto_mixed_precision(net, "O2")``); ``"partial"``: by the test, the backbone of a
    ``WithLossCell`` only; ``"auto"``: not by the test (mindzero converts a network with no setup of its own).
    """

    name: str
    model: str
    optimizer: str
    stage: object  # "dp" or 0..3
    settings: dict = field(default_factory=dict)  # prepare_train_network's options (not zero_stage)
    steps: int = STEPS
    force_overflow: bool = False
    substitute: bool = False
    amp: str = "O2"
    tier: str = DEFAULT
    reference: str = ""
    mode: str = "graph"

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"scenario {self.name!r}: tier must be one of {TIERS}, got {self.tier!r}")
        if self.model not in MODELS:
            raise ValueError(f"scenario {self.name!r}: model {self.model!r} is not one of {sorted(MODELS)}")
        if self.optimizer not in {*OPTIMIZERS, "adamw_groups"}:
            raise ValueError(f"scenario {self.name!r}: optimizer {self.optimizer!r} is unknown")
        if self.stage not in ("dp", 0, 1, 2, 3):
            raise ValueError(f"scenario {self.name!r}: stage must be 'dp' or 0-3, got {self.stage!r}")
        if self.mode not in ("graph", "pynative"):
            raise ValueError(f"scenario {self.name!r}: mode must be 'graph' or 'pynative', got {self.mode!r}")
        if self.amp not in ("O2", "partial", "auto"):
            raise ValueError(f"scenario {self.name!r}: amp must be 'O2', 'partial' or 'auto', got {self.amp!r}")
        if "zero_stage" in self.settings:
            raise ValueError(f"scenario {self.name!r}: give the stage as stage=, not in settings")
        check_settings(self.settings, f"scenario {self.name!r}")

    @property
    def accumulation(self) -> int:
        return self.settings.get("gradient_accumulation_steps", 1)

    @property
    def mixed_precision(self) -> bool:
        return self.settings.get("param_dtype") is not None


def thirds(model: str) -> dict:
    """``comm_fusion`` with buckets of about a third of ``model``'s trainable bytes, for every kind."""
    bucket = trainable_bytes(model) // 3
    return {kind: {"openstate": True, "bucket_size": bucket} for kind in ("allreduce", "reduce_scatter", "allgather")}


# every model with its optimizer; the parity runs train the GPT with SGD's weight decay too (1e-5 bar)
MODEL_OPTIMIZERS = [(m, "sgd_decay" if m == "gpt" else DEFAULT_OPTIMIZER[m]) for m in PARITY_MODELS]
# mixed precision on networks as users build them (no to_float anywhere): mindzero converts them
AUTO_AMP_MODELS = (("mlp", "adam"), ("gpt", "sgd_decay"), ("normed", "adamw"))
AUTO_AMP_STEPS = 20


#: stage 3's gather_units scenarios: each equals its ``reference`` bit for bit (the same values gathered, the same
#: per-parameter reductions). The default suite keeps the Cell rule on the GPT (tied weights kept out) and the
#: GPU/Ascend path; the size rule, frozen weights and param_dtype run in the full tier.
UNITS = [Scenario("units-gpt-3", "gpt", "sgd_decay", 3, {"gather_units": "block"}, reference="gpt-3"),
         Scenario("units-mixed-3", "mixed", "adamw_groups", 3, {"gather_units": 1 << 20}, tier=FULL, reference="mixed-3"),
         Scenario("units-lora-3", "lora", "adamw", 3, {"gather_units": 1 << 20}, tier=FULL, reference="lora-3"),
         Scenario("mp-units-3", "mixed", "adamw_groups", 3, {**FP16, "gather_units": 1 << 20}, force_overflow=True,
                  tier=FULL, reference="mp-mixed-3"),
         Scenario("real-units-3", "mixed", "adamw_groups", 3, {**CLIP, "gather_units": trainable_bytes("mixed") // 2},
                  substitute=True, reference="real-3")]


#: stage 3's persistence threshold (stage3_param_persistence_threshold): the TinyGPT's biases and norms (16 and 48
#: elements; its weights and tables have 128 or more) kept whole and all-reduced in one fused call. Each row trains
#: bit for bit as its ``reference`` (on CPU a reduce-scatter is an all-reduce and a slice: the same sums; under
#: hybrid sharding, ``persist-h3``, the sharded sums run in another order: 1 ulp, test_hybrid.py); below
#: stage 3 the option changes nothing. ``persist-clip-3``: the mixed net's clipped run, whose global norm adds the
#: persistent gradients' squares once beside the shards' (another order of the same sum: held to the parity bar).
#: The cap in all (``stage3_model_persistence_threshold``, by default 1% of these small models) is lifted, so that
#: every such tensor is kept; the other stage-3 rows run the defaults (the 1% cap keeps a few of the smallest).
NO_PERSISTENCE_CAP = 10 ** 12  # stage3_model_persistence_threshold above any test model: no cap in all
PERSIST = {"stage3_param_persistence_threshold": 100, "stage3_model_persistence_threshold": NO_PERSISTENCE_CAP}
PERSISTS = [*(Scenario(f"persist-gpt-{stage}", "gpt", "sgd_decay", stage, PERSIST, reference=f"gpt-{stage}",
                       tier=DEFAULT if stage == 3 else FULL) for stage in (0, 1, 2, 3)),
            Scenario("persist-clip-3", "mixed", "adamw_groups", 3, {**CLIP, **PERSIST}, reference="clip-3"),
            Scenario("mp-persist-3", "mixed", "adamw_groups", 3, {**FP16, **PERSIST}, force_overflow=True,
                     tier=FULL, reference="mp-mixed-3")]


#: owner mode (mindone's CAME: factored statistics and an RMS clip, so every sharded parameter is updated whole on
#: one owner rank) on the mixed net (an fp16 cell, a recompute block, a replicated bias) with each feature of the step;
#: each row equals its stage-0 twin (``<name>-0``), plain DP is ``came-dp``
OWNER_FEATURES = {"came": {}, "came-clip": CLIP, "came-overflow": {"scale_sense": DYNAMIC},
                  "came-accum": {"gradient_accumulation_steps": 4}, "came-mp": FP16, "came-ema": EMA}
#: the default suite's stages of each (stage 2 plain: came-overflow-2 and came-accum-2 run its path on the same net, and
#: the optimizer launch trains CAME at stage 1, whose graph stage 2 compiles without accumulation)
OWNER_DEFAULT = {"came": (3,), "came-clip": (3,), "came-overflow": (2,), "came-accum": (2, 3), "came-mp": (3,),
                 "came-ema": (3,)}


def with_references(rows) -> list:
    """``pytest.param(name, reference, id=name)`` of each row: the parameters of a test that compares each row with
    the run it equals."""
    import pytest

    return [pytest.param(s.name, s.reference, id=s.name) for s in rows]


def single_micro(stage) -> str:
    """The tier of a parity row without accumulation at ``stage``: stage 2 with one micro-step per update compiles
    stage 1's graph node for node, in the same depth-first kernel order (tests/single/test_one_process.py), so such rows
    run in the full tier; the default suite runs stage 2 where it differs (every ``accum``, ``mp-accum``,
    ``came-accum``, ``disk-accum`` and ``real-accum`` row: gradients reduce-scattered at each micro-step into sharded
    buffers), the mixed net's plain row (``mixed-2``: the memory report) and owner mode with a skipped overflow
    (``came-overflow-2``)."""
    return FULL if stage == 2 else DEFAULT


def owner_scenarios(full: bool) -> list:
    """The owner-mode rows of the parity launch: every feature at stages 0-3 (2 ranks; 4 ranks: stages 0 and 3, and
    2 with accumulation, stage 3's bit-for-bit reference),
    the default suite's (:data:`OWNER_DEFAULT`) and their stage-0 twins in the default tier."""
    out = [Scenario("came-dp", "mixed", "came", "dp")]
    for name, settings in OWNER_FEATURES.items():
        for stage in (0, 1, 2, 3) if full else (0, 2, 3) if name == "came-accum" else (0, 3):
            default = stage == 0 or stage in OWNER_DEFAULT[name]
            out.append(Scenario(f"{name}-{stage}", "mixed", "came", stage, settings,
                                force_overflow=name in ("came-overflow", "came-mp"),
                                tier=DEFAULT if default else FULL))
    return out


def in_tier(scenarios, full_tier: bool) -> list:
    """The scenarios a tier runs: every one in the full tier, the ``"default"`` ones in the default suite."""
    return [s for s in scenarios if full_tier or s.tier == DEFAULT]


def parity_scenarios(world_size: int = 2, full_tier: bool = True) -> list:
    """Every scenario of one parity launch (without ``full_tier``, the default suite's: the rows of tier
    ``"full"`` left out). 2 ranks run the full matrix. 4 ranks (to keep the suite's time) run
    every model at every stage, accumulation at every stage (the memory accounting) and ``mp-accum``
    (accumulation, clipping and EMA in fp16) at every stage, but clipping, forced overflow, EMA, comm_fusion and
    the mixed net in fp16 and the mint.optim rows at stages 0 and 3 only, offload at stage 3, gpt and resnet in fp16 at stages 0 and 3
    (stage 3: its own fp16 code path: fp16 gathers, reduce_dtype in the gather's backward).

    The default suite's 2-rank launch leaves the rows marked ``tier=FULL`` to the full tier, each with a sibling
    that runs its code path: stage 2 without accumulation but the mixed net's row (:func:`single_micro`: it compiles
    stage 1's graph node for node), mindzero's fp16 conversion (``auto-``) at stages 1-2 (stages 1-2 share their
    reduction with mp-mixed-1, and stage 2 compiles stage 1's graph) and of the gpt and normed nets at stage 3 (the
    mlp's stays), the normed net's altogether (tests/single/test_precision.py converts it at stages 0 and 3), fp16
    of the gpt and resnet nets at every stage and of the lora net at stages 1-2 (mp-mixed keeps fp16 at stages 0, 1
    and 3 and mp-accum at every stage, mp-lora-3 frozen fp16 weights at stage 3, the hybrid launch's mp-h3 the mixed
    net in fp16 at stage 3 inside op groups), the gather_units rows by size, on frozen weights and with param_dtype
    (:data:`UNITS`), the persistence threshold below stage 3 (it changes nothing there: the parsed option is empty
    below stage 3, tests/unit/test_persistence.py), EMA at stages 1-2 (mp-accum-1/2 keep it), the fused GPU/Ascend
    path at stages 1-2 (real-fused-3 keeps the fused rows, real-1 and real-accum-2 the stages), the mint.optim rows
    at stages 0-2 (their stage 3 stays, against the plain-DP reference loop) and owner mode plain at stages 1-2 and
    in fp16 at stage 1 (the optimizer launch runs CAME at stages 1 and 3, came-overflow-2 and came-accum-2 owner
    mode at stage 2 on the mixed net, test_checkpoint.py trains and resumes it in fp16 at stage 1).
    """
    full = world_size == 2
    some = (0, 1, 2, 3) if full else (0, 3)
    # stage 2 with one micro-step per update: the mixed net's row (the memory report's) in the default suite
    out = [Scenario(f"{model}-{stage}", model, opt, stage, tier=DEFAULT if model == "mixed" else single_micro(stage))
           for model, opt in MODEL_OPTIMIZERS for stage in ("dp", 0, 1, 2, 3)]
    for stage in some:
        out.append(Scenario(f"clip-{stage}", "mixed", "adamw_groups", stage, CLIP, tier=single_micro(stage)))
        out.append(Scenario(f"overflow-{stage}", "mixed", "adamw_groups", stage, {"scale_sense": DYNAMIC},
                            force_overflow=True, tier=single_micro(stage)))
    for stage in ("dp", 0, 1, 2, 3):
        out.append(Scenario(f"accum-{stage}", "awkward", "adam", stage, {"gradient_accumulation_steps": 4}))
    for stage in some:  # stages 1-2's EMA (after the write-back gather) also runs in mp-accum-1/2
        out.append(Scenario(f"ema-{stage}", "mixed", "adamw_groups", stage, EMA,
                            tier=FULL if stage in (1, 2) else DEFAULT))
    for stage in (1, 3) if full else (3,):
        out.append(Scenario(f"offload-{stage}", "mixed", "adamw_groups", stage, {"optimizer_offload": True}))
    for model, opt in [m for m in MODEL_OPTIMIZERS if m[0] != "awkward"]:
        for stage in some:  # fp16 params, fp32 masters, dynamic scale
            # the gpt and resnet in fp16 wholly in the full tier (their stage 0 only serves their stages 1-3)
            full_only = model in ("gpt", "resnet") or (model == "lora" and stage in (1, 2))
            out.append(Scenario(f"mp-{model}-{stage}", model, opt, stage, FP16, force_overflow=model == "mixed",
                                tier=FULL if full_only else single_micro(stage)))
    if full:
        out.append(Scenario("mp-offload-3", "mixed", "adamw_groups", 3, {**FP16, "optimizer_offload": True},
                            force_overflow=True))
        for name, settings in (("mp-long-0", FP16), ("fp32-long-0", {"scale_sense": DYNAMIC})):  # fp16 vs fp32
            out.append(Scenario(name, "mixed", "adamw_groups", 0, settings, steps=20, force_overflow=True))
        for stage in (0, 3):  # gradients reduced in fp32
            out.append(Scenario(f"mp32-mixed-{stage}", "mixed", "adamw_groups", stage,
                                {**FP16, "reduce_dtype": "float32"}, force_overflow=True))
    for stage in (0, 1, 2, 3):  # accumulation (buffers in fp16), clipping, EMA
        out.append(Scenario(f"mp-accum-{stage}", "awkward", "adam", stage,
                            {**FP16, **CLIP, **EMA, "gradient_accumulation_steps": 4}))
    if full:  # param_dtype on float32 networks without a setup of their own: mindzero converts them (20 steps)
        for model, opt in AUTO_AMP_MODELS:
            # the normed net's conversion at stages 0 and 3 is tests/single/test_precision.py's too
            out += [Scenario(f"auto-{model}-{stage}", model, opt, stage, FP16, steps=AUTO_AMP_STEPS, amp="auto",
                             tier=FULL if stage in (1, 2) or (stage == 3 and model != "mlp") or model == "normed"
                             else DEFAULT)
                    for stage in (0, 1, 2, 3)]
            out.append(Scenario(f"auto32-{model}-0", model, opt, 0, {"scale_sense": DYNAMIC}, steps=AUTO_AMP_STEPS,
                                tier=FULL if model == "normed" else DEFAULT))
        # the backbone converted by the user, the loss Cell not: kept exactly as it is
        out += [Scenario(f"partial-mlp-{stage}", "mlp", "adam", stage, FP16, amp="partial") for stage in (0, 3)]
    for stage in some:  # the clip-<stage> runs with comm_fusion buckets
        out.append(Scenario(f"fused-{stage}", "mixed", "adamw_groups", stage, {**CLIP, "comm_fusion": thirds("mixed")},
                            tier=single_micro(stage)))
    if full:  # the GPU/Ascend path (real ReduceScatter, fused row layout) with CPU-legal primitives
        for stage in (1, 2, 3):
            for fused in (False, True):
                settings = {**CLIP, "comm_fusion": thirds("mixed")} if fused else CLIP
                out.append(Scenario(f"real-{'fused-' if fused else ''}{stage}", "mixed", "adamw_groups", stage,
                                    settings, substitute=True,
                                    tier=FULL if fused and stage in (1, 2) else single_micro(stage)))
        out.append(Scenario("real-mp-3", "mixed", "adamw_groups", 3, FP16, force_overflow=True, substitute=True))
        out.append(Scenario("real-accum-2", "awkward", "adam", 2, {"gradient_accumulation_steps": 4}, substitute=True))
    if full:  # the optimizer states on disk, bit for bit as the same run in memory (2 ranks; tests/single too)
        # (the default suite: one row per feature, each stage once; the full tier: the rest)
        out += [Scenario(f"disk-clip-{stage}", "mixed", "adamw_groups", stage, {**CLIP, **DISK},
                         reference=f"clip-{stage}", tier=DEFAULT if stage == 3 else FULL) for stage in (1, 2, 3)]
        out += [Scenario(f"disk-overflow-{stage}", "mixed", "adamw_groups", stage, {"scale_sense": DYNAMIC, **DISK},
                         force_overflow=True, reference=f"overflow-{stage}", tier=DEFAULT if stage == 1 else FULL)
                for stage in (1, 3)]
        out += [Scenario(f"disk-mp-{stage}", "mixed", "adamw_groups", stage, {**FP16, **DISK}, force_overflow=True,
                         reference=f"mp-mixed-{stage}", tier=DEFAULT if stage == 3 else FULL) for stage in (1, 3)]
        out += [Scenario(f"disk-accum-{stage}", "awkward", "adam", stage, {"gradient_accumulation_steps": 4, **DISK},
                         reference=f"accum-{stage}", tier=DEFAULT if stage == 2 else FULL) for stage in (2, 3)]
    # MindSpore's torch-style optimizers against the plain-DP reference loop (tests.support.worker.ReferenceStep):
    # Adam with AMSGrad and two groups; SGD with Nesterov momentum, accumulation and clipping on the tied GPT (not
    # the awkward net: mint.optim.SGD itself fails to compile on its 0-d parameter, "For 'Assign' ... dimension")
    # (4 ranks: stages 0 and 3, as the other features; stages 1-2, whose flat update is every flat optimizer's,
    # and stage 0, which leaves the optimizer as it is, in the full tier: the optimizer launch runs mint's at stage 3
    # against plain DP too)
    for stage in ("dp", *some):
        tier = FULL if stage in (0, 1, 2) and full else DEFAULT
        out.append(Scenario(f"mint-adam-{stage}", "mixed", "mint_adam", stage, tier=tier))
        out.append(Scenario(f"mint-sgd-{stage}", "gpt", "mint_sgd", stage,
                            {**CLIP, "gradient_accumulation_steps": 2}, tier=tier))
    out += owner_scenarios(full)
    if full:  # PyNative: the same step op by op, bit for bit the graph-mode run of each stage
        out += PYNATIVE
    names = {s.name for s in out}
    # 4 ranks: the default tier's rows whose reference runs there (real-3 is not in the reduced matrix)
    out += [u for u in UNITS + PERSISTS if u.reference in names and (full or u.tier == DEFAULT)]
    return in_tier(out, full_tier)


#: PyNative (2 ranks): the tied GPT at every stage (stages 1 and 2 in the full tier: stage 2 by
#: :func:`single_micro`, stage 1's sharded update runs after backward in the compiled part, as stage 3's does), each
#: against PyNative stage 0, which is held against graph mode's; and stage 3 with accumulation against its
#: graph-mode run.
#: (The mixed net's recompute block is refused at stage 3 in PyNative: its recompute would lose the gather's gradient.)
PYNATIVE = [Scenario("pyn-gpt-0", "gpt", "sgd_decay", 0, mode="pynative", reference="gpt-0"),
            *(Scenario(f"pyn-gpt-{stage}", "gpt", "sgd_decay", stage, mode="pynative", reference="pyn-gpt-0",
                       tier=DEFAULT if stage == 3 else FULL) for stage in (1, 2, 3)),
            Scenario("pyn-accum-3", "awkward", "adam", 3, {"gradient_accumulation_steps": 4}, mode="pynative",
                     reference="accum-3")]


HYBRID = {"hybrid_shard_size": 2}


#: the hybrid rows of the default suite; the others run in the full tier, each beside a default row of its code path
#: (the mixed net runs hybrid stages 0-3, and stage 3 with gather_units, the persistence threshold and param_dtype;
#: every model runs every stage in the 2-rank parity launch; clipping, overflow and owner mode keep one hybrid stage
#: each, accumulation stage 3 (stage 2's reduce-scatter inside the op groups runs in mixed-h2, overflow-h2 and
#: real-h2), the GPU/Ascend path one unfused and one fused stage; the GPT's rows, which compile about twice as long
#: on 4 ranks, in the full tier: its tied weights at stage 3 run in the parity launch)
HYBRID_DEFAULT = {"mixed-dp", "mixed-h0", "mixed-h1", "mixed-h2", "mixed-h3", "clip-dp0", "clip-h3", "overflow-dp0",
                  "overflow-h2", "accum-dp", "accum-h3", "mp-flat0", "mp-h3", "units-h3", "persist-h3", "came-dp",
                  "came-h3", "real-h2", "real-fused-h3"}
#: the nets stage 3's options run on under hybrid sharding (net, optimizer, the prefix of their rows' names)
_HYBRID_NETS = (("mixed", "adamw_groups", ""), ("gpt", "sgd_decay", "gpt-"))
#: stage 3's options under hybrid sharding, each row with the run it equals (``reference``): gather_units (the mixed
#: net in two units by size, the GPT by its block) and the persistence threshold against the same net's hybrid stage
#: 3, param_dtype=float16 inside the op groups against flat stage 0 with the same policy (``mp-...flat0``)
HYBRID_UNITS = [Scenario(f"units-{prefix}h3", net, opt, 3,
                         {**HYBRID, "gather_units": trainable_bytes(net) // 2 if net == "mixed" else "block"},
                         reference=f"{net}-h3") for net, opt, prefix in _HYBRID_NETS]
HYBRID_PERSISTS = [Scenario(f"persist-{prefix}h3", net, opt, 3, {**HYBRID, **PERSIST}, reference=f"{net}-h3")
                   for net, opt, prefix in _HYBRID_NETS]
HYBRID_FP16 = [Scenario(f"mp-{prefix}h3", net, opt, 3, {**HYBRID, **FP16}, reference=f"mp-{prefix}flat0")
               for net, opt, prefix in _HYBRID_NETS]


def hybrid_scenarios(full_tier: bool = True) -> list:
    """Every scenario of the hybrid launch (4 ranks, op groups of 2, two replicas) and its plain-DP references
    (without ``full_tier``, the default suite's: :data:`HYBRID_DEFAULT`)."""
    out = []
    for model, opt in MODEL_OPTIMIZERS:
        out.append(Scenario(f"{model}-dp", model, opt, "dp"))
        out += [Scenario(f"{model}-h{stage}", model, opt, stage, HYBRID) for stage in (0, 1, 2, 3)]
    out += [Scenario(f"clip-h{stage}", "mixed", "adamw_groups", stage, {**HYBRID, **CLIP}) for stage in (1, 2, 3)]
    out.append(Scenario("overflow-dp0", "mixed", "adamw_groups", 0, {"scale_sense": DYNAMIC}, force_overflow=True))
    out += [Scenario(f"overflow-h{stage}", "mixed", "adamw_groups", stage, {**HYBRID, "scale_sense": DYNAMIC},
                     force_overflow=True) for stage in (1, 2, 3)]
    out.append(Scenario("clip-dp0", "mixed", "adamw_groups", 0, CLIP))
    out.append(Scenario("accum-dp", "awkward", "adam", "dp", {"gradient_accumulation_steps": 4}))
    out += [Scenario(f"accum-h{stage}", "awkward", "adam", stage, {**HYBRID, "gradient_accumulation_steps": 4})
            for stage in (2, 3)]
    out += [Scenario(f"mp-{prefix}flat0", net, opt, 0, FP16) for net, opt, prefix in _HYBRID_NETS]
    out += HYBRID_FP16 + HYBRID_UNITS + HYBRID_PERSISTS
    # owner mode inside the op groups (an owner per op group; the broadcast emulated on CPU): mindone's CAME
    out.append(Scenario("came-dp", "mixed", "came", "dp"))
    out += [Scenario(f"came-h{stage}", "mixed", "came", stage, HYBRID) for stage in (1, 2, 3)]
    for stage in (1, 2, 3):  # the GPU/Ascend path: op-group ReduceScatter + dp-group AllReduce, CPU-legal
        for fused in (False, True):
            settings = {**HYBRID, **CLIP, **({"comm_fusion": thirds("mixed")} if fused else {})}
            out.append(Scenario(f"real-{'fused-' if fused else ''}h{stage}", "mixed", "adamw_groups", stage, settings,
                                substitute=True))
    out = [dataclasses.replace(s, tier=DEFAULT if s.name in HYBRID_DEFAULT else FULL) for s in out]
    return in_tier(out, full_tier)


@dataclass(frozen=True)
class CheckpointCase:
    """One checkpoint scenario of ``worker_checkpoint.py``: train, save into ``ckpt`` (``format``; in the
    background with ``async_save``; also one full file at ``full_path``), or load it in fresh processes."""

    name: str
    model: str
    stage: int
    ckpt: str
    format: str = "ckpt"
    full_path: str = None
    param_dtype: str = None
    async_save: bool = False
    optimizer: str = ""  # a name of tests.support.models.OPTIMIZERS; "": momentum for the resnet, else adamw
    persist: int = None  # stage3_param_persistence_threshold (the cap in all lifted); None: the defaults

    def __post_init__(self):
        if not self.optimizer:
            object.__setattr__(self, "optimizer", "momentum" if self.model == "resnet" else "adamw")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"checkpoint case {self.name!r}: optimizer {self.optimizer!r} is unknown")


def cases_arg(cases) -> str:
    """The ``--cases`` command-line argument of ``worker_checkpoint.py`` for a list of :class:`CheckpointCase`."""
    return json.dumps([dataclasses.asdict(c) for c in cases])

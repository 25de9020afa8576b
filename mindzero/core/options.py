"""The table of :func:`mindzero.prepare_train_network`'s options (pure Python): each written once, with its default,
what it accepts and whether a settings file can hold it; and the one rule for an option given both as an argument
and by a settings file. The parsers that enforce what each accepts are :mod:`mindzero.core.config`'s policies.
:class:`mindzero.ZeroCheckpoint`'s options are :class:`CheckpointOptions` (the end of this module).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from .checks import is_int, require_bool, require_int
from .offload import DEFAULT_CHUNK_MB


@dataclass(frozen=True)
class Option:
    """One option of :func:`mindzero.prepare_train_network`: its name, its default, what it accepts (the rule its
    parser enforces, as docs/training.md's option list shows it), whether a settings file can hold it, and
    whether it is a keyword argument (``hybrid_shard_size`` is the file's stand-in for the two group names)."""

    name: str
    default: object
    accepts: str
    in_settings: bool = True
    argument: bool = True


#: every option, in ``prepare_train_network``'s order (mindone's for the first sixteen: positional calls keep
#: working): the one table its signature, the settings file, :meth:`ZeroConfig.from_arguments` and the docs'
#: option list are checked against (tests/unit/test_config.py, tests/single/test_public_api.py)
OPTIONS = (
    Option("scale_sense", 1.0, "a number > 0, a scalar Tensor, a loss-scale update Cell, or "
                               "`{init_loss_scale, scale_factor, scale_window}`"),
    Option("ema", None, "`None`, a decay in (0, 1), or mindone's `EMA`"),
    Option("updates", 0, "an int >= 0: the EMA's initial step count (needs `ema`)"),
    Option("drop_overflow_update", True, "a bool"),
    Option("gradient_accumulation_steps", 1, "an int >= 1"),
    Option("clip_grad", False, "a bool"),
    Option("clip_norm", 1.0, "a number > 0"),
    Option("verbose", False, "a bool"),
    Option("zero_stage", 0, "0, 1, 2 or 3"),
    Option("optimizer_offload", False, "a bool, `\"host\"` (= `True`) or `\"disk\"` (stages 1-3, with `offload_dir`)"),
    Option("optimizer_parallel_group", None, "`None` or a group name", in_settings=False),
    Option("dp_group", None, "`None` or a group name", in_settings=False),
    Option("comm_fusion", None, "`None` or `{kind: {openstate, bucket_size}}` for the kinds allreduce, reduce_scatter, allgather"),
    Option("parallel_modules", None, "`None` (mindone's; not needed)", in_settings=False),
    Option("stage3_regather", True, "a bool (stage 3)"),
    Option("param_dtype", None, "`None`, float16 or bfloat16"),
    Option("reduce_dtype", None, "`None`, float32, float16 or bfloat16"),
    Option("shard_frozen", True, "a bool (stage 3)"),
    Option("gather_quantization", None, "`None`, `\"int8\"` or `{kind, block_size, min_numel, exclude}` (stage 3)"),
    Option("gather_units", None, "`None`, bytes per unit, or Cell-name patterns (stage 3, graph mode)"),
    Option("stage3_param_persistence_threshold", 100_000,
           "an int >= 0: parameters of fewer elements are kept whole (stage 3; 0: shard every parameter)"),
    Option("stage3_model_persistence_threshold", None,
           "`None` (1% of the model's elements) or an int >= 0: the most elements kept whole in all (stage 3)"),
    Option("offload_dir", None, "`None` or a directory (with `optimizer_offload=\"disk\"`): each rank's state file "
                                "goes in `rank_<r>/` under it"),
    Option("offload_chunk_mb", DEFAULT_CHUNK_MB, "a number > 0: MiB of optimizer states streamed per piece (disk offload)"),
    Option("offload_keep", False, "a bool: leave the state files at exit (disk offload)"),
    Option("compile_cache", None, "`None` or a directory: the compiled train step is kept there, under a key of "
                                  "everything that shapes it, and the next launch with the same key loads it"),
    Option("update_sharding", "auto", "`\"auto\"` (flat shards where the update is element-wise, else an owner rank) "
                                      "or `\"owner\"` (every sharded parameter updated whole on one owner rank)"),
    Option("hybrid_shard_size", None, "`None` or an int >= 1: ranks per op group", argument=False),
)
#: option name -> default
ARGUMENT_DEFAULTS = {o.name: o.default for o in OPTIONS}
#: the options a settings file cannot hold (objects of the running job)
NOT_IN_SETTINGS = tuple(o.name for o in OPTIONS if not o.in_settings)


def options_markdown() -> str:
    """The option list of docs/training.md, made from :data:`OPTIONS` (a test holds the page to it)."""
    rows = ["| option | default | accepts | settings file |", "|---|---|---|---|"]
    rows += [f"| `{o.name}` | `{o.default!r}` | {o.accepts} | {'yes' if o.in_settings else 'no'}"
             f"{'' if o.argument else ' (only there)'} |" for o in OPTIONS]
    return "\n".join(rows)


def off_defaults(explicit: dict, defaults: dict = None) -> dict:
    """The arguments of ``explicit`` whose value is not their default (``defaults``: :data:`ARGUMENT_DEFAULTS`);
    types count: ``1`` is not ``True``."""
    defaults = ARGUMENT_DEFAULTS if defaults is None else defaults
    return {k: v for k, v in explicit.items() if not (type(v) is type(defaults[k]) and v == defaults[k])}


def merge_settings(explicit: dict, settings: dict, defaults: dict = None) -> dict:
    """The options of a call given both as arguments and by a settings file: ``settings`` plus the
    arguments that differ from their defaults (``defaults``: :data:`ARGUMENT_DEFAULTS`). The one rule for
    both sources: a setting given both ways is refused, naming both values.

    Raises:
        ValueError: ``"<key> is given both as an argument (<value>) and in config (<value>); give each setting
            once"``.
    """
    given = off_defaults(explicit, defaults)
    both = sorted(set(given) & set(settings))
    if both:
        k = both[0]
        raise ValueError(f"{k} is given both as an argument ({given[k]!r}) and in config ({settings[k]!r}); "
                         "give each setting once")
    return {**settings, **given}


CHECKPOINT_FORMATS = ("ckpt", "safetensors")


@dataclass(frozen=True)
class CheckpointOptions:
    """How :class:`mindzero.ZeroCheckpoint` saves: into ``dir``, every ``save_every`` steps (``None``: at the
    end only), keeping the newest ``keep`` (0: all), in ``format``, in the background (``async_save``).
    Validated on construction; a settings file's ``checkpoint`` section has the same keys."""

    dir: Optional[str] = None
    save_every: Optional[int] = None
    keep: int = 2
    format: str = "ckpt"
    async_save: bool = False

    def __post_init__(self):
        if self.dir is not None and (not isinstance(self.dir, str) or self.dir == ""):
            raise ValueError(f"dir must be a non-empty path, got {self.dir!r}")
        if self.save_every is not None and (not is_int(self.save_every) or self.save_every < 1):
            raise ValueError(f"save_every must be None (save at the end only) or an int >= 1 (train steps), got "
                             f"{self.save_every!r}")
        require_int("keep", self.keep, 0)
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"format must be one of {list(CHECKPOINT_FORMATS)}, got {self.format!r}")
        require_bool("async_save", self.async_save)

    @staticmethod
    def keys() -> tuple:
        return tuple(f.name for f in fields(CheckpointOptions))

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.keys()}




@dataclass(frozen=True)
class Variable:
    """An environment variable mindzero (or its test suite) reads: its name, who reads it, and what it does."""

    name: str
    read_by: str
    does: str


#: every ``MINDZERO_*`` variable read anywhere in mindzero or its tests, and MindSpore's own that mindzero reads or
#: sets (docs/reference.md is generated from it; tests/single/test_reference.py finds every one in the sources)
VARIABLES = (
    Variable("MINDZERO_DEVICE", "`start_data_parallel`, `mindzero-env`",
             "the device to set (`CPU`, `GPU`, `Ascend`, any case) when `device=` is not given; unset: MindSpore's own"),
    Variable("MINDZERO_SUBSTITUTE_COLLECTIVES", "worlds made by `prepare_train_network`",
             "`1`: test-only, run the GPU/Ascend code on CPU with its group primitives substituted"),
    Variable("MINDZERO_PYNATIVE_OP_BY_OP", "the train step in PyNative",
             "`1`: run the reductions and the update op by op too, instead of as one compiled graph (slower; for "
             "stepping through them or hooking their primitives)"),
    Variable("MINDZERO_LOG_DIR", "`python -m mindzero.launch`", "where rank 0 writes the scheduler's log (default `.`)"),
    Variable("MINDZERO_FULL_SUITE", "the test suite", "`1`: run the full tier (as `--full`)"),
    Variable("MS_COMPILER_CACHE_ENABLE", "`prepare_train_network`",
             "MindSpore's process-wide compile cache: when `1`, mindzero compiles its own graphs without it (warned)"),
    Variable("MS_ROLE", "`python -m mindzero.launch`, `mindzero-env`",
             "set by msrun: a process already in MindSpore's cluster (the launcher maps nothing)"),
    Variable("MS_SCHED_HOST, MS_SCHED_PORT", "`python -m mindzero.launch`",
             "the scheduler's address; the launcher sets them (and `MS_WORKER_NUM`, `MS_NODE_ID`) from mpirun's, PMI's "
             "or Slurm's rank and size"),
)

"""The state of one ZeRO train step: one record per optimized parameter, one per communication bucket.

[Note: mindzero tensors] (the vocabulary of the core; :mod:`mindzero.core.plan` defines shard and padding)

* **full parameter** (``ParamState.param``): the network's Parameter as the user built it. Stages 0-2
  keep it whole on every rank; at stage 3 the network holds a shard under the same name, the state drops
  the full one, and the full value exists only while a Cell reads it (:mod:`mindzero.engine.stage3`).
* **weight** (``ParamState.weight``): what gradients are taken with respect to: the full parameter
  (stages 0-2; a split parameter's own shard, and its rest beside it) or its stage-3 shard.
* **target** (``ParamState.target``): what the optimizer updates: the weight, a stage 1-2 *master
  shard* (with ``param_dtype``: ``zero_master.<name>``, this rank's fp32 slice of the parameter, written
  back by an all-gather after each update), or, with ``param_dtype``, an fp32 *master* of a weight held in
  fp16/bf16. Stage 1 without ``param_dtype`` *splits* each sharded parameter (:mod:`mindzero.engine.split`):
  the network holds this rank's shard (the weight and target, under the parameter's name) and the rest
  (``zero_rest.<name>``, written by the all-gather), so no element is held twice.
* **sharded** (``ParamState.sharded``): the stage shards this parameter's optimizer state (stage >= 1
  and the plan shards the parameter); from stage 2 its gradient, at stage 3 its value. A parameter the
  plan replicates (``ShardSpec.reason``) is never sharded.
* **op group** / **world** (:class:`mindzero.core.topology.World`): the ranks a tensor is sharded over (``G``),
  and all ranks (``N``); reductions sum over the world.
* **bucket** (:class:`CommBucket`): tensors that travel in one collective (``comm_fusion``), or one
  tensor without fusion.

Pure Python (no MindSpore import): the records hold MindSpore objects but do not build them;
:mod:`mindzero.engine.assemble` fills them and the train Cell reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# what a gradient is at clip time, for the global norm (the kernel mindzero.engine.kernels.norm_sq)
REPLICATED, SHARD, OWN_SLICE = 0, 1, 2
# how a bucket is reduced
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = 1, 2, 3


@dataclass(eq=False)
class MasterPair:
    """A master the optimizer updates and the network tensor it is written back into after each update:
    ``shard_of_full``: the master is a stage 1-2 shard of the full ``held`` (all-gathered back), else it has
    ``held``'s shape (stage 0 and replicated parameters, stage-3 shards: cast and assigned locally).
    ``split`` (stage 1 without ``param_dtype``, :mod:`mindzero.engine.split`): the master is the network's
    own shard of the parameter and ``held`` the rest (the other op ranks' shards): the all-gather writes the
    rest, and no element is held twice."""

    master: object
    held: object
    shard_of_full: bool
    split: bool = False


@dataclass(eq=False)
class ParamState:
    """One optimized parameter, in optimizer order (see the note at the top)."""

    name: str  # the parameter's name (at stage 3 also the name of the shard the network holds)
    param: object  # the network's full Parameter; None once stage 3 has replaced it by its shard (so that
    #                nothing keeps the full value alive)
    spec: object  # its mindzero.core.plan.ShardSpec, dtype as held
    reduce_spec: object  # the same with the dtype its gradient is reduced in (reduce_dtype)
    sharded: bool  # optimizer state sharded (stage >= 1 and the plan shards it)
    weight: object = None  # what gradients are taken w.r.t.: the parameter or its stage-3 shard
    target: object = None  # what the optimizer updates
    master: Optional[MasterPair] = None  # how the target is written back into the weight, if it is not it
    accum: object = None  # the gradient accumulation buffer (K > 1): full, or a shard from stage 2

    @property
    def norm_kind(self) -> int:
        """At clip time the gradient is a shard (sharded), the full gradient of a plan-sharded parameter
        at stage 0 (this rank counts its own slice), or replicated (counted once)."""
        return SHARD if self.sharded else OWN_SLICE if self.spec.sharded else REPLICATED


@dataclass(eq=False)
class CommBucket:
    """Gradients (or master shards) that travel in one collective: their positions in optimizer order, the
    collective's kind (:data:`ALL_REDUCE` / :data:`REDUCE_SCATTER`; :data:`ALL_GATHER` for the stage 1-2
    write-back), and their specs (as reduced, or as held for the write-back)."""

    positions: tuple
    kind: int
    specs: tuple


@dataclass(eq=False)
class ZeroState:
    """What :func:`mindzero.prepare_train_network` built for a train step: ``train_net.zero_info``, read by
    the train Cell, memory reports, checkpoints and tools. Made once, complete (:mod:`mindzero.engine.assemble`)."""

    config: object  # mindzero.core.config.ZeroConfig
    world: object  # mindzero.core.topology.World
    plan: object  # mindzero.core.plan.PartitionPlan (every network parameter)
    params: tuple = ()  # ParamState per optimized parameter, optimizer order
    micro: tuple = ()  # CommBucket: reductions of every micro-step (stage 2)
    boundary: tuple = ()  # CommBucket: reductions at the accumulation boundary
    gather: tuple = ()  # CommBucket: stage 1-2 all-gathers of the updated master shards (positions into
    #                     the shard-of-full master pairs, see master_pairs)
    state_attrs: tuple = ()  # the optimizer's per-parameter state tuples (attribute names)
    scale_sense: object = None  # the loss-scale Parameter
    loss_scale_manager: object = None  # nn.DynamicLossScaleUpdateCell or None
    ema: object = None  # mindzero.engine.train_step.ZeroEMA or None
    regather: bool = True  # stage 3, graph mode: gather again in backward (stage3_regather)
    units: tuple = ()  # stage 3 gather_units: the parameter names of each unit gathered in one collective
    # mindzero.core.comm_plan.Call per collective of one optimizer step (comm_plan.state_calls, filled at assembly):
    calls: tuple = ()  # as this world runs them
    real_calls: tuple = ()  # with real reduce-scatter and sub-group collectives (what GPU/Ascend run)
    offload: object = None  # optimizer_offload="disk": mindzero.engine.offload.DiskOffload (the states' file)

    @property
    def fusion(self):
        return self.config.fusion

    @property
    def precision(self):
        return self.config.precision

    @property
    def weights(self) -> list:
        return [p.weight for p in self.params]

    @property
    def opt_param_names(self) -> tuple:
        """Full parameter names in optimizer order."""
        return tuple(p.name for p in self.params)

    @property
    def accum_buffers(self) -> tuple:
        return tuple(p.accum for p in self.params if p.accum is not None)

    @property
    def master_pairs(self) -> tuple:
        """:class:`MasterPair` per master the optimizer updates: the stage 1-2 shards (all-gathered back)
        first, then the masters cast back locally (``param_dtype``), each in optimizer order."""
        pairs = [p.master for p in self.params if p.master is not None]
        return tuple([m for m in pairs if m.shard_of_full] + [m for m in pairs if not m.shard_of_full])

    @property
    def master_shards(self) -> tuple:
        """The masters held beside the network's parameters (a split pair's own shard is the parameter)."""
        return tuple(pair.master for pair in self.master_pairs if not pair.split)

    @property
    def split_pairs(self) -> tuple:
        """The split pairs (:class:`MasterPair` with ``split``), optimizer order."""
        return tuple(pair for pair in self.master_pairs if pair.split)

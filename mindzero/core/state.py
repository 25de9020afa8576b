"""The state of one ZeRO train step: one record per optimized parameter, one per communication bucket.

[Note: mindzero tensors] (the vocabulary of the core; :mod:`mindzero.core.plan` defines shard and padding)

* **full parameter** (``ParamState.param``): the network's Parameter as the user built it. Stages 0-2
  keep it whole on every rank; at stage 3 the network holds a shard under the same name, the state drops
  the full one, and the full value exists only while a Cell reads it (:mod:`mindzero.engine.stage3`).
* **weight** (``ParamState.weight``): what gradients are taken with respect to: the full parameter
  (stages 0-2: the user's own Parameter, untouched) or its stage-3 shard.
* **target** (``ParamState.target``): what the optimizer updates (:mod:`mindzero.core.optim_plan` says how
  the update is shared out): the weight; a stage 1-2 flat parameter's *master shard* (``zero_master.<name>``,
  this rank's slice of the parameter, in fp32 with ``param_dtype``, all-gathered back into the full parameter
  after each update); with ``param_dtype`` an fp32 *master* of a weight held in fp16/bf16; for an owner-mode
  parameter on its owner the parameter itself (stages 1-2 without ``param_dtype``) or its full master, and on
  every other rank a stand-in of a few elements.
* **sharded** (``ParamState.sharded``): the stage shares this parameter's optimizer state out (stage >= 1 and
  the plan shards the parameter: flat shards or an owner, ``ParamState.update``); its gradient is
  reduce-scattered (from stage 2 where backward produces it), at stage 3 its value is sharded. A parameter the
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

from .optim_plan import FLAT, OWNER

# what a gradient is at clip time, for the global norm (the kernel mindzero.engine.kernels.norm_sq)
REPLICATED, SHARD, OWN_SLICE = 0, 1, 2
# how a bucket travels
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST_FROM = 1, 2, 3, 4


# how a master is written back into the tensor the network holds after each update
GATHER, CAST, BROADCAST = "gather", "cast", "broadcast"

# what the optimizer updates for one parameter (ParamState.target): the weight itself, a stage 1-2 flat master
# shard, an owner's full master, a stand-in of a few elements (a non-owner), an fp32 copy of a weight held in
# param_dtype
WEIGHT, MASTER_SHARD, FULL_MASTER, STAND_IN, WIDE_COPY = "weight", "master shard", "full master", "stand-in", "fp32 copy"


@dataclass(frozen=True)
class Role:
    """One parameter's sharding decision: what the optimizer updates (``target``: :data:`WEIGHT`,
    :data:`MASTER_SHARD`, :data:`FULL_MASTER`, :data:`STAND_IN` or :data:`WIDE_COPY`) and how that is written back
    into the weight after each update (``master``: :data:`GATHER`, :data:`BROADCAST`, :data:`CAST`, or ``None``
    where the target is the weight or a stand-in)."""

    target: str
    master: Optional[str] = None


def role_of(shard_parameters: bool, mode: str, owned: bool, mixed: bool, held_low: bool) -> Role:
    """The one table of what a parameter's optimizer target is, by stage (``shard_parameters``: stage 3), update mode
    (:mod:`mindzero.core.optim_plan`'s modes), whether this rank owns it, whether the
    run is mixed precision and whether the parameter is held in ``param_dtype`` (``held_low``):

    * owner mode, another rank's: a stand-in;
    * owner mode, this rank's: a full master, broadcast after the update, at stage 3 (the network holds a shard)
      and with mixed precision (fp32); else (stages 1-2 in fp32) the weight itself, the user's Parameter;
    * flat at stages 1-2: a master shard, all-gathered into the weight;
    * otherwise (flat at stage 3: the weight is the shard; whole): an fp32 copy cast back into a weight held in
      ``param_dtype``, else the weight.
    """
    if mode == OWNER:
        if not owned:
            return Role(STAND_IN)
        return Role(FULL_MASTER, BROADCAST) if shard_parameters or mixed else Role(WEIGHT)
    if mode == FLAT and not shard_parameters:
        return Role(MASTER_SHARD, GATHER)
    return Role(WIDE_COPY, CAST) if mixed and held_low else Role(WEIGHT)


@dataclass(eq=False)
class MasterPair:
    """A master the optimizer updates and the network tensor (``held``) it is written back into after each update,
    by ``kind``: :data:`GATHER` (a stage 1-2 flat master shard, all-gathered into the full ``held``), :data:`CAST`
    (the same shape as ``held``: cast and assigned locally; ``param_dtype``), :data:`BROADCAST` (an owner-mode
    parameter's full master on its owner, broadcast to every rank; ``master`` is ``None`` on the other ranks).

    Before each update the master takes up a value written into ``held`` since the last one (``refresh``: a user's
    ``mindspore.load_checkpoint`` into the network at stages 0-2 reaches the optimizer): a flat master shard is
    this rank's slice of ``held``; a ``param_dtype`` master keeps its fp32 value wherever ``held`` still equals it
    cast, and takes ``held``'s value elsewhere."""

    master: object
    held: object
    kind: str

    @property
    def refresh(self) -> bool:
        """Whether the master is refreshed from ``held`` before each update (every kind but a stage-3 owner's, whose
        ``held`` is a shard: ``mindzero.load_checkpoint`` / ``load_pretrained`` write that master)."""
        return self.master is not None and (self.kind != BROADCAST or tuple(self.master.shape) == tuple(self.held.shape))


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
    update: object = None  # its mindzero.core.optim_plan.Update: flat, owner (and which op rank) or whole
    all_reduced: bool = False  # its gradient is all-reduced whole though it is sharded (a stage-1 owner-mode
    #                            parameter: mindzero.core.comm_plan.reduced_whole)
    role: Optional[Role] = None  # what the optimizer updates and how it is written back (role_of)

    @property
    def norm_kind(self) -> int:
        """At clip time the gradient is a shard (sharded), the full gradient of a plan-sharded parameter
        (stage 0, or all-reduced whole for its owner: this rank counts its own slice), or replicated (counted
        once)."""
        return SHARD if self.sharded and not self.all_reduced else OWN_SLICE if self.spec.sharded else REPLICATED


@dataclass(eq=False)
class CommBucket:
    """Gradients (or updated values) that travel in one collective: their positions in optimizer order, the
    collective's kind (:data:`ALL_REDUCE` / :data:`REDUCE_SCATTER`; :data:`ALL_GATHER` for the stage 1-2
    write-back of flat master shards and for the gradients an owner gathers; :data:`BROADCAST_FROM` for the
    write-back of owner-mode parameters from their owner, op rank ``root``), and their specs (as reduced, or as
    held for a write-back)."""

    positions: tuple
    kind: int
    specs: tuple
    root: Optional[int] = None


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
    gather: tuple = ()  # CommBucket: stage 1-2 all-gathers of the updated flat master shards (positions in
    #                     optimizer order)
    owner_grads: tuple = ()  # CommBucket: the all-gathers of owner-mode gradient shards before the update (buckets)
    broadcasts: tuple = ()  # CommBucket: the write-back of owner-mode parameters, one per owner and dtype
    state_attrs: tuple = ()  # the optimizer's per-parameter state tuples (attribute names)
    scale_sense: object = None  # the loss-scale Parameter
    loss_scale_manager: object = None  # nn.DynamicLossScaleUpdateCell or None
    ema: object = None  # mindzero.engine.train_step.ZeroEMA or None
    regather: bool = True  # stage 3, graph mode: gather again in backward (stage3_regather)
    gathers: tuple = ()  # stage 3: mindzero.core.units.WeightGather per weight all-gather the network runs
    # mindzero.core.comm_plan.Call per collective of one optimizer step (comm_plan.state_calls, filled at assembly):
    calls: tuple = ()  # as this world runs them
    real_calls: tuple = ()  # with real reduce-scatter and sub-group collectives (what GPU/Ascend run)
    offload: object = None  # optimizer_offload="disk": mindzero.engine.offload.OffloadFile (the states' file)
    layout: object = None  # mindzero.engine.optim.OptimizerLayout: the optimizer's roles, as re-pointed
    order: object = None  # a scalar Parameter the update's collectives are chained through (train_step's note)

    @property
    def ordered(self) -> bool:
        """Whether the update's collectives are chained through ``order``: only where the ranks compile different
        update graphs, which owner mode alone makes (an owner updates a parameter whole, the others a stand-in).
        Elsewhere every rank compiles the same graph, so MindSpore's scheduler issues the collectives in the same
        order on every rank, and the chain would only add nodes to compile (a load, an add, an assign and their
        ordering per collective: a quarter of a stage-1 step's graph)."""
        return bool(self.owner_grads or self.broadcasts)

    @property
    def units(self) -> tuple:
        """The parameter names of each ``gather_units`` unit (several parameters in one all-gather)."""
        return tuple(g.names for g in self.gathers if g.unit)

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
    def updates(self) -> tuple:
        """The :class:`~mindzero.core.optim_plan.Update` of each optimized parameter, optimizer order."""
        return tuple(p.update for p in self.params)

    @property
    def master_pairs(self) -> tuple:
        """:class:`MasterPair` per master the optimizer updates, optimizer order."""
        return tuple(p.master for p in self.params if p.master is not None)

    def masters_of(self, kind: str) -> tuple:
        """The :class:`MasterPair` of ``kind``, optimizer order."""
        return tuple(m for m in self.master_pairs if m.kind == kind)

    @property
    def master_shards(self) -> tuple:
        """The masters this rank holds beside the network's parameters."""
        return tuple(pair.master for pair in self.master_pairs if pair.master is not None)

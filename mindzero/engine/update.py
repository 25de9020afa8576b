"""The update's side of the train step (:mod:`mindzero.engine.train_step`, step 7): before the optimizer, every
master takes up a value written into the network's tensor (:class:`Refresh`) and owner-mode gradients are
gathered to their owners (:class:`OwnerGradients`); after it, the write-back (:class:`WriteBack`): stages 1-2
all-gather the updated flat master shards into the full parameters (:class:`GatherInto`), owners broadcast what
they updated, ``param_dtype`` masters are cast back.

Every update collective comes from the step's :class:`~mindzero.comm.cells.UpdateCollectives`, which chains each
through ``state.order`` where owner mode makes the ranks' update graphs differ (``state.ordered``: the train step's
module note), so every one runs after the one before it.
"""
from __future__ import annotations

from mindspore import ParameterTuple, nn, ops

from ..comm.cells import Bucket, UpdateCollectives
from ..core.optim_plan import OWNER, placeholder_shape
from ..core.state import CAST, GATHER, ZeroState
from ..core.topology import World
from .kernels import (AS_REDUCED, GATHER_FOR_OTHER, GATHER_FOR_OWNER, MAP, STAND_IN, broadcast_input, broadcast_write,
                      gather_bucket, gather_unit, gather_write, owner_grad, refresh, write_cast)


class GatherInto(nn.Cell):
    """Stages 1-2: all-gather updated flat master shards, each written into its full network parameter (one
    all-gather per ``comm_fusion`` bucket; per tensor without fusion). ``units``: the ``gather``
    :class:`~mindzero.core.state.CommBucket` (positions in optimizer order); ``fulls`` / ``shards``: the
    parameters and their master shards, one per optimizer position (``None`` where none is gathered);
    ``collectives``: the step's :class:`~mindzero.comm.cells.UpdateCollectives`."""

    def __init__(self, units, collectives: UpdateCollectives, fulls, shards):
        super().__init__(auto_prefix=False)
        order = [i for u in units for i in u.positions]
        at = {i: k for k, i in enumerate(order)}
        self.fulls = ParameterTuple([fulls[i] for i in order])
        self.shards = ParameterTuple([shards[i] for i in order])
        self.positions = tuple(tuple(at[i] for i in u.positions) for u in units)
        self.buckets = tuple(Bucket.of(u.specs) for u in units)
        self.per_tensor = all(len(pos) == 1 for pos in self.positions)
        self.gather = collectives.all_gather() if self.per_tensor else collectives.fused_all_gather()
        self.gathers = (self.gather,) * (len(order) if self.per_tensor else len(units))  # mapped (kernels note)

    def construct(self, after):
        """Gather after ``after``; returns ``after`` made to depend on every write."""
        if self.per_tensor:
            done = MAP(ops.partial(gather_write, after), self.gathers, self.fulls, self.shards)
        else:
            done = MAP(ops.partial(gather_unit, after, self.fulls, self.shards), self.gathers, self.positions,
                       self.buckets)
        return ops.depend(after, done)


class _OwnerBroadcast(nn.Cell):
    """One bucket of an owner's updated parameters of one dtype (a ``broadcasts``
    :class:`~mindzero.core.state.CommBucket`, at most :data:`~mindzero.core.comm_plan.OWNER_BUCKET_BYTES`
    unless ``comm_fusion`` sets the allgather bucket): the owner sends what it updated (cast to the network's dtype),
    every other rank receives into its own copy (stages 1-2) or a zero buffer of the full shape (stage 3); then
    every rank writes the value, or at stage 3 its shard of it, into the network's tensor."""

    def __init__(self, bucket, state: ZeroState, collectives: UpdateCollectives):
        super().__init__(auto_prefix=False)
        world = state.world
        params = [state.params[i] for i in bucket.positions]
        self.op = collectives.broadcast(bucket.root)
        self.bucket = Bucket.of(bucket.specs)
        self.mine = tuple(ps.update.owned_by(world.op_rank) for ps in params)
        self.sources = ParameterTuple([ps.target for ps in params])
        self.helds = ParameterTuple([ps.weight for ps in params])
        self.shapes = tuple(tuple(ps.spec.shape) for ps in params)
        self.paddings = tuple(ps.spec.padding for ps in params)
        self.sharded = state.config.policy.shard_parameters
        self.op_rank, self.op_size = world.op_rank, world.op_size

    def construct(self, after):
        values = MAP(ops.partial(broadcast_input, after, self.sharded), self.mine, self.shapes, self.sources,
                     self.helds)
        out = self.op(values, self.bucket)
        done = MAP(ops.partial(broadcast_write, self.op_rank, self.op_size, self.sharded), self.paddings, self.helds,
                   out)
        return ops.depend(after, done)


class WriteBack(nn.Cell):
    """After the optimizer step: stages 1-2 all-gather the updated flat master shards into the full parameters
    (:class:`GatherInto`, in the parameters' dtype); every owner broadcasts its updated owner-mode parameters
    (:class:`_OwnerBroadcast`, one after the other, in the plan's order: the same collectives on every rank); with
    ``param_dtype`` every other master is cast to ``param_dtype`` and assigned to its network parameter (no
    communication)."""

    def __init__(self, state: ZeroState, collectives: UpdateCollectives):
        super().__init__(auto_prefix=False)
        self.has_gather = bool(state.gather)
        if self.has_gather:
            self.gather = GatherInto(state.gather, collectives, [ps.weight for ps in state.params],
                                     [ps.target for ps in state.params])
        self.broadcasts = nn.CellList([_OwnerBroadcast(b, state, collectives) for b in state.broadcasts],
                                      auto_prefix=False)
        self.has_broadcast = bool(state.broadcasts)
        local = state.masters_of(CAST)
        self.has_local = bool(local)
        if self.has_local:
            self.helds = ParameterTuple([pair.held for pair in local])
            self.masters = ParameterTuple([pair.master for pair in local])

    def construct(self, after):
        """Write after ``after``; returns ``after`` made to depend on every write."""
        if self.has_gather:
            after = self.gather(after)
        if self.has_broadcast:
            for broadcast in self.broadcasts:
                after = broadcast(after)
        if self.has_local:
            after = ops.depend(after, MAP(ops.partial(write_cast, after), self.helds, self.masters))
        return after


class Refresh(nn.Cell):
    """Before each update, every master takes up a value written into the network's tensor since the last one
    (:class:`~mindzero.core.state.MasterPair`): a flat master shard becomes this rank's slice of the parameter; a
    ``param_dtype`` master keeps its value where the network's copy equals it cast, and takes the copy's value
    elsewhere. Without such a write both leave every master as it was, bit for bit."""

    def __init__(self, state: ZeroState):
        super().__init__(auto_prefix=False)
        params = [ps for ps in state.params if ps.master is not None and ps.master.refresh]
        self.masters = ParameterTuple([ps.master.master for ps in params])
        self.helds = ParameterTuple([ps.master.held for ps in params])
        self.sliced = tuple(ps.master.kind == GATHER for ps in params)
        self.paddings = tuple(ps.spec.padding for ps in params)
        self.op_rank, self.op_size = state.world.op_rank, state.world.op_size
        self.empty = not params

    def construct(self, after):
        """Returns ``after`` made to depend on every refresh."""
        if self.empty:
            return after
        return ops.depend(after, MAP(ops.partial(refresh, after, self.op_rank, self.op_size), self.masters,
                                     self.helds, self.sliced, self.paddings))


def handed(ps, op_rank: int) -> int:
    """What the optimizer of op rank ``op_rank`` is handed for ``ps``'s gradient (:data:`AS_REDUCED`,
    :data:`GATHER_FOR_OWNER`, :data:`GATHER_FOR_OTHER` or :data:`STAND_IN`)."""
    mine = ps.update.owned_by(op_rank)
    if ps.update.mode != OWNER or (mine and ps.all_reduced):
        return AS_REDUCED
    if ps.all_reduced:
        return STAND_IN
    return GATHER_FOR_OWNER if mine else GATHER_FOR_OTHER


class OwnerGradients(nn.Cell):
    """Owner mode: its owner hands each owner-mode parameter's full gradient to the optimizer (at stages 2-3
    all-gathered from the reduced shards on every rank, one fused all-gather per ``owner_grads`` bucket, in
    optimizer order; as all-reduced at stage 1), every other rank a stand-in of zeros (of the stand-in's shape;
    made after the gather where there is one). Other gradients pass as they are."""

    def __init__(self, state: ZeroState, collectives: UpdateCollectives):
        super().__init__(auto_prefix=False)
        n, op_rank = len(state.params), state.world.op_rank
        buckets = state.owner_grads
        self.has_gathers = bool(buckets)
        if self.has_gathers:
            gather = collectives.fused_all_gather()
            self.gather = gather
            self.gathers = (gather,) * len(buckets)  # mapped beside the buckets (kernels note)
            self.positions = tuple(b.positions for b in buckets)
            self.buckets = tuple(Bucket.of(b.specs) for b in buckets)
        # where each gradient handed on comes from: (bucket, member) of a gathered one, else (-1, its position)
        source = {i: (k, j) for k, b in enumerate(buckets) for j, i in enumerate(b.positions)}
        self.sources = tuple(source.get(i, (-1, i)) for i in range(n))
        self.kinds = tuple(handed(ps, op_rank) for ps in state.params)
        self.numels = tuple(ps.spec.numel for ps in state.params)
        self.shapes = tuple(tuple(ps.spec.shape) for ps in state.params)
        self.stand_ins = tuple(placeholder_shape(ps.spec.shape, ps.spec.shape) for ps in state.params)

    def construct(self, grads):
        gathered = ()
        if self.has_gathers:
            gathered = MAP(ops.partial(gather_bucket, grads), self.gathers, self.positions, self.buckets)
        return MAP(ops.partial(owner_grad, grads, gathered), self.sources, self.kinds, self.numels, self.shapes,
                   self.stand_ins)

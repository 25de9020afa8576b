"""The ZeRO train step: one Cell that does forward, backward, reduction, overflow, clipping and the update.

Per step (``gradient_accumulation_steps = K``; ``N`` ranks in the op group):

1. forward and backward of the user's network with the loss scaled by the loss
   scale; gradients are taken w.r.t. the optimizer's parameters in the
   optimizer's own order (full parameters at stages 0-2, shards at stage 3);
2. *micro-step reduction*: stage 2 reduce-scatters each sharded gradient now
   (a sum over the world); stage 3 got it already reduced from the gather's
   ``bprop``; stages 0-1 keep the local full gradient;
3. with ``K > 1`` the result is added to accumulation buffers (full at stages
   0-1, shards at stages 2-3) and steps 4-7 run on every K-th call only;
4. *boundary reduction*: stage 0 all-reduces every gradient, stage 1
   reduce-scatters sharded ones, every stage all-reduces replicated ones
   (with ``comm_fusion``, one collective per bucket); then one multiply
   divides every gradient by ``loss_scale * K * N`` (N = the world),
   making the sums means;
5. overflow: every rank checks its (shard of the) gradients for inf/nan and
   one all-reduce of the flags makes the decision shared by all ranks; a
   ``DynamicLossScaleUpdateCell`` updates the loss scale from it;
6. ``clip_grad``: the global norm is the square root of one all-reduce of the
   shards' sums of squares plus the replicated gradients' (counted once);
7. unless the step overflowed (and ``drop_overflow_update``), every master
   first takes up a value written into the network's tensor since the last
   update (a user's ``mindspore.load_checkpoint`` into the network); owner-mode
   parameters' reduced gradient shards are all-gathered (the owner updates them
   whole, :mod:`mindzero.core.optim_plan`); the optimizer updates what this rank
   holds (flat shards from stage 1 on, the owned parameters whole); stages 1-2
   all-gather every updated flat master shard into the full parameter, and each
   owner broadcasts its updated parameters (stage 3: every rank keeps its shard
   of them); ``param_dtype`` masters are cast back.

Where the optimizer's states live is the store's business (``states``, :mod:`mindzero.engine.states`): in memory
step 7 is the graph's; with ``optimizer_offload="disk"`` the graph hands the reduced gradients over and records
whether the update is due or skipped, and the store streams the update from disk after the graph
(:mod:`mindzero.engine.offload`).

In graph mode every rank compiles its own graph: owner mode makes the optimizer's work differ between ranks (one
updates a parameter whole, the others a stand-in of a few elements), never the collectives: every rank issues the
same collectives, from the same buckets (:func:`mindzero.core.comm_plan.step_buckets`). Where the graphs differ,
MindSpore's scheduler would order independent collectives differently on different ranks (two all-gathers of
different sizes would meet: "RingAllGather Memcpy error"), so every collective of the update waits for the one
before it: each records itself in ``state.order`` (a scalar Parameter) and the next reads it first (MindSpore keeps
reads and writes of a Parameter in program order). The update's collectives all come from one
:class:`~mindzero.comm.cells.UpdateCollectives` (:func:`_states`), which chains every one it makes, so no call site
can leave the chain out. Without owner mode every rank compiles the same graph and the factory chains nothing
(``state.ordered``): the chain would add a quarter of a stage-1 step's graph to compile and order nothing the
scheduler does not.

Returns ``(loss, overflow, loss_scale)`` like ``nn.TrainOneStepWithLossScaleCell``;
``loss`` is this rank's local loss of the micro-batch.
"""
from __future__ import annotations

import contextlib
import os

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from ..comm.cells import (AllReduceSum, AnyRank, Bucket, FusedAllReduceSum, FusedReduceScatterSum, ReduceScatterSum,
                          UpdateCollectives)
from ..core.optim_plan import OWNER
from ..core.state import CAST, REDUCE_SCATTER, REPLICATED, SHARD, ZeroState
from ..core.topology import World
from ..core.host import release_host_memory
from .compile_cache import cached_compile, without_process_cache
from .kernels import (ALL, MAP, accumulate, cast_to, depend_on, ema_update, finite, norm_sq, reduce_grad, reduce_unit,
                      route, scale_by, zero_after)
from .precision import explain_dtype_errors
from .offload import DiskStates
from .states import InMemoryStates, UpdateTail
from .update import OwnerGradients, Refresh, WriteBack


class _Keep(nn.Cell):
    def construct(self, g, padding):
        return g


class _SumAll(nn.Cell):
    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world, "world")

    def construct(self, g, padding):
        return self.sum(g)


class _SumShard(nn.Cell):
    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.reduce_scatter = ReduceScatterSum(world)

    def construct(self, g, padding):
        return self.reduce_scatter(g.reshape((-1,)), padding)


class Reduction(nn.Cell):
    """Reduce a tuple of gradients bucket by bucket (:class:`~mindzero.core.state.CommBucket`, kind
    ``ALL_REDUCE``: sum over the world, full tensors; ``REDUCE_SCATTER``: sum over the world, this rank's
    padded 1D shard); one collective per bucket (one tensor per bucket without ``comm_fusion``). Positions
    in no bucket pass through. With ``scale`` every output is multiplied by
    ``factor`` right after its collective (as ``DistributedGradReducer`` does with the mean), so no second
    full copy of the gradients is made later; with ``widen`` (mixed precision) it is cast to fp32 first.

    Communication: one collective per unit, in unit order.
    """

    def __init__(self, n: int, units, world: World, scale: bool = False, widen: bool = False):
        super().__init__(auto_prefix=False)
        self.scale = scale
        self.widen = widen
        self.positions = tuple(tuple(u.positions) for u in units)
        self.per_tensor = all(len(pos) == 1 for pos in self.positions)
        if self.per_tensor:  # one Map over the gradients, each with its reducer (the common case)
            keep, sum_all, sum_shard = _Keep(), _SumAll(world), _SumShard(world)
            reducers, paddings = [keep] * n, [0] * n
            for u in units:
                (i,), (spec,) = u.positions, u.specs
                reducers[i] = sum_shard if u.kind == REDUCE_SCATTER else sum_all
                paddings[i] = spec.padding
            self.reducers, self.paddings = tuple(reducers), tuple(paddings)
            self.reducer_cells = nn.CellList([keep, sum_all, sum_shard])
            return
        allreduce, reduce_scatter = FusedAllReduceSum(world), FusedReduceScatterSum(world)
        self.reducer_cells = nn.CellList([allreduce, reduce_scatter])
        self.reducers = tuple(reduce_scatter if u.kind == REDUCE_SCATTER else allreduce for u in units)
        self.buckets = tuple(Bucket.of(u.specs) for u in units)
        # where gradient i is after the buckets, in (the gradients, then each bucket's results in order): a
        # position, or for a member of a fused all-reduce (one flat sum) the sum's position, the member's offset
        # and size in it, and its shape
        sources, at = list(range(n)), n
        for u, pos, bucket in zip(units, self.positions, self.buckets):
            if u.kind == REDUCE_SCATTER or len(pos) == 1:
                for i in pos:
                    sources[i], at = at, at + 1
                continue
            for i, spec, numel, offset in zip(pos, u.specs, bucket[0], bucket[3]):
                sources[i] = (at, offset, numel, tuple(spec.shape))
            at += 1
        self.sources = tuple(sources)

    def construct(self, grads, factor):
        if self.per_tensor:
            return MAP(ops.partial(reduce_grad, factor, self.scale, self.widen), self.reducers, self.paddings,
                        grads)
        values = grads
        for members in MAP(ops.partial(reduce_unit, grads), self.reducers, self.positions, self.buckets):
            values = values + members  # one concatenation per bucket
        return MAP(ops.partial(route, values, factor, self.scale, self.widen), self.sources)


class ZeroEMA(nn.Cell):
    """Exponential moving average of the optimizer's parameters, held like them: full at stages 0-2,
    shards at stage 3 (named ``ema.<parameter>``, as mindone's ``EMA``).

    After each update ``ema = d * ema + (1 - d) * param`` with mindone's warm-up
    ``d = decay * (1 - exp(-updates / 2000))``; a step skipped for overflow leaves the EMA and
    ``updates`` unchanged.
    """

    def __init__(self, weights, decay: float, updates: int, dtype=None):
        super().__init__(auto_prefix=False)
        self.ema_weights = ParameterTuple([Parameter(Tensor(w.asnumpy().copy(), dtype or w.dtype),
                                                     name="ema." + w.name, requires_grad=False) for w in weights])
        self.updates = Parameter(Tensor(float(updates), ms.float32), name="ema_updates", requires_grad=False)
        self.decay = float(decay)

    def construct(self, weights, skipped):
        keep = ops.cast(skipped, ms.float32)
        updates = self.updates + (1.0 - keep)
        d = self.decay * (1.0 - ops.exp(-updates / 2000.0))
        d = keep + (1.0 - keep) * d  # 1 on a skipped step: the EMA stays as it is
        done = MAP(ops.partial(ema_update, d), self.ema_weights, weights)
        return ops.depend(ops.assign(self.updates, updates), done)


@contextlib.contextmanager
def _execution_order(order):
    """Compile under MindSpore's kernel execution order ``order`` (``"dfs"``/``"bfs"``; ``None``: as set).

    The order is fixed when a graph compiles and the runtime keeps it; it decides when each kernel's output
    is freed. MindSpore's default (``bfs``) runs the consumers of the per-gradient reductions late, so every
    full gradient is alive at the end of backward even where its reduction follows its production in the
    graph; ``dfs`` runs each reduction right after the gradient it reduces (docs/stages.md). The
    context setting is process-wide: it is restored at once.
    """
    if order is None:
        yield
        return
    previous = ms.get_context("exec_order")
    ms.set_context(exec_order=order)
    try:
        yield
    finally:
        ms.set_context(exec_order=previous)


class ZeroTrainOneStepCell(nn.Cell):
    """Train step of :func:`mindzero.prepare_train_network`; see the module docstring for the phases.

    Built by ``prepare_train_network``, which prepares the pieces (shards, reducers,
    optimizer re-pointing); this Cell only orders them.
    """

    def __init__(self, network, optimizer, state: ZeroState):
        super().__init__(auto_prefix=False)
        config, world = state.config, state.world
        self.zero_info = state  # what the step was built from: read by memory reports, checkpoints and tools
        self.network = network
        self.network.set_grad()
        self.optimizer = optimizer
        n = len(state.params)
        self.weights = ParameterTuple(state.weights)
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        # stage 2 reduce-scatters each micro-step's gradients; the other reductions wait for the accumulation
        # boundary. Without accumulation every micro-step is a boundary: one reduction does both (each gradient's
        # collective is the same node of the graph), and none is compiled that would keep every gradient as it is.
        micro, boundary = state.micro, state.boundary
        if config.gradient_accumulation_steps == 1:
            micro, boundary = (), micro + boundary  # (disjoint: sharded and replicated gradients)
        self.micro = Reduction(n, micro, world)
        self.has_micro = len(micro) > 0
        # mixed precision widens to fp32 at the boundary (the optimizer's masters)
        self.boundary = Reduction(n, boundary, world, scale=True, widen=config.precision.widens)
        # per gradient (optimizer order): (norm kind, padding) for the clip norm (see norm_sq_one)
        self.norm_kinds = tuple(ps.norm_kind for ps in state.params)
        self.norm_paddings = tuple(ps.reduce_spec.padding for ps in state.params)
        self.has_sharded_norm = any(kind != REPLICATED for kind in self.norm_kinds)
        self.op_rank, self.op_size = world.op_rank, world.op_size
        self.refresh = Refresh(state)
        # gradients are reduced (and accumulated) in reduce_dtype (mixed precision, or 16-bit reduction alone)
        self.reduce_dtype = getattr(ms, config.precision.reduce_in) if config.precision.reduce_in else None
        self.accum_steps = config.gradient_accumulation_steps
        self.world_size = world.world_size
        if self.accum_steps > 1:
            self.accum_buffers = ParameterTuple(state.accum_buffers)
            self.micro_step = Parameter(Tensor(0, ms.int32), name="zero_micro_step", requires_grad=False)
        self.scale_sense = state.scale_sense
        self.has_manager = state.loss_scale_manager is not None
        if self.has_manager:
            self.loss_scaling_manager = state.loss_scale_manager
        self.drop_overflow_update = config.drop_overflow_update
        self.clip_grad = config.clip_grad
        self.clip_norm = float(config.clip_norm)
        self.any_rank = AnyRank(world)
        self.sum_over_group = AllReduceSum(world, "op")  # each shard once, not once per replica
        self.has_ema = state.ema is not None
        if self.has_ema:
            self.ema = state.ema
        self.states = _states(state, optimizer, self.weights)
        # stages that shard reduce each gradient to its shard where backward produces it: compiled in depth-first
        # order (stage 1 without accumulation is stage 2's graph; with it, each micro-gradient is freed once added)
        self.exec_order = "dfs" if config.policy.shard_optimizer_states else None
        self.set_train(True)
        self._compiled = False
        self._cache_looked = False
        self._after_jit = None  # PyNative: the compiled steps after backward (_eager)

    def compile(self, *args, **kwargs):
        """Compile the step (graph mode), in the kernel execution order of its stage (see ``exec_order``)."""
        config, world = self.zero_info.config, self.zero_info.world
        # MindSpore calls compile at every call: only the first compile looks for the step in compile_cache
        cache = without_process_cache() if self._cache_looked else \
            cached_compile(self, args, config, world)
        with _execution_order(self.exec_order), explain_dtype_errors(self.network, config.precision), cache:
            compiled = super().compile(*args, **kwargs)
        self._cache_looked = True
        return compiled

    def __call__(self, *args, **kwargs):
        if ms.get_context("mode") != ms.GRAPH_MODE:
            loss, overflow, scale, handoff = self._eager(*args)
        else:
            if not self._compiled:
                # compile first, then give the compiler's freed heap back to the OS before the step allocates
                # its own memory (glibc keeps it resident otherwise; docs/performance.md)
                self.compile(*args, **kwargs)
                release_host_memory()
            self._compiled = True
            loss, overflow, scale, handoff = super().__call__(*args, **kwargs)
        self.states.after_step(handoff)
        return loss, overflow, scale

    def _eager(self, *inputs):
        """PyNative: forward and backward op by op, then everything after backward (reductions, overflow, clipping,
        the update and its write-back) compiled once and run as one graph (``mindspore.jit``), as MindSpore runs its
        own gradient reducers and optimizers in PyNative: op by op, each of those per-parameter collectives and
        kernels would wait for the one before it."""
        loss, grads, scale = self._forward_backward(*inputs)
        if os.environ.get("MINDZERO_PYNATIVE_OP_BY_OP") == "1":
            overflow, scale, handoff = self._after_backward(grads, scale)
            return loss, overflow, scale, handoff
        if self._after_jit is None:
            self._after_jit = ms.jit(self._after_backward)
        # mutable: the gradients are the graph's inputs, not constants to compile it anew for at every step
        overflow, scale, handoff = self._after_jit(ms.mutable(grads), scale)
        return loss, overflow, scale, handoff

    def construct(self, *inputs):
        loss, grads, scale = self._forward_backward(*inputs)
        overflow, scale, handoff = self._after_backward(grads, scale)
        return loss, overflow, scale, handoff

    def _forward_backward(self, *inputs):
        scale = self.scale_sense * 1.0
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, ops.cast(scale, loss.dtype))
        return loss, self.grad(self.network, self.weights)(*inputs, sens), scale

    def _after_backward(self, grads, scale):
        """Steps 2-7 of the module note: ``(overflow, scale, the store's handoff)``."""
        if self.reduce_dtype is not None:
            grads = MAP(ops.partial(cast_to, self.reduce_dtype), grads)
        if self.has_micro:
            grads = self.micro(grads, scale)  # (no scaling here: the factor is applied once, at the boundary)
        if self.accum_steps == 1:
            overflow, grads = self._apply(grads, scale)
            due = ops.ones((), ms.bool_)
        else:
            step = ops.depend(self.micro_step + 1, MAP(accumulate, self.accum_buffers, grads))
            ops.assign(self.micro_step, step)
            overflow = ops.zeros((), ms.bool_)
            due = step % self.accum_steps == 0
            if due:
                grads = MAP(ops.partial(depend_on, step), self.accum_buffers)
                overflow, _ = self._apply(grads, scale)
                overflow = ops.depend(overflow, MAP(ops.partial(zero_after, overflow), self.accum_buffers))
        return overflow, scale, self.states.handoff(due, self._skipped(overflow), grads)

    def _apply(self, grads, scale):
        # every reduction is a sum over the world: one multiply by 1 / (loss_scale * K * N), right after each
        # collective, makes the sums means of the unscaled gradients
        inv = ops.reciprocal(ops.cast(scale, ms.float32) * (self.accum_steps * self.world_size))
        grads = self.boundary(grads, inv)
        overflow = self.any_rank(ops.logical_not(ALL(ops.stack(MAP(finite, grads)))))
        if self.has_manager:
            overflow = self.loss_scaling_manager(self.scale_sense, overflow)
        if self.clip_grad:
            grads = self._clip(grads)
        if self.drop_overflow_update:
            if not overflow:
                overflow = self._update(grads, overflow)
        else:
            overflow = self._update(grads, overflow)
        return self.states.settle(self._skipped(overflow), overflow), grads

    def _skipped(self, overflow):
        """Whether this update step's update is skipped: it overflowed and ``drop_overflow_update`` is set."""
        return overflow if self.drop_overflow_update else ops.zeros((), ms.bool_)

    def _update(self, grads, after):
        """The optimizer step: the masters refreshed (:class:`Refresh`), then the store's update
        (:mod:`mindzero.engine.states`): in memory, owner-mode gradients gathered (:class:`OwnerGradients`), the
        optimizer, then the write-back (:class:`WriteBack`): stages 1-2 all-gather every updated flat master shard
        into its parameter, owners broadcast theirs, mixed precision casts the others.

        The gather sits in the same branch as the update: after the branch the runtime would hold the gathered
        values across the branch boundary (about half the parameter bytes of memory pool at stage 1)."""
        return self.states(grads, self.refresh(after))

    def _clip(self, grads):
        """Scale every gradient by ``clip_norm / max(global_norm, clip_norm)``.

        The norm is canonical: whatever the stage, each rank sums the squares of the
        slices the partition plan gives it, one all-reduce adds them, and replicated
        gradients are added once. Every stage therefore gets the same clip factor to
        the bit (a plain full-tensor norm would differ from the sharded one in rounding).
        """
        total_sq = ops.addn(MAP(ops.partial(norm_sq, REPLICATED, self.op_rank, self.op_size), self.norm_kinds,
                                 self.norm_paddings, grads))
        if self.has_sharded_norm:
            sharded_sq = ops.addn(MAP(ops.partial(norm_sq, SHARD, self.op_rank, self.op_size), self.norm_kinds,
                                       self.norm_paddings, grads))
            total_sq = self.sum_over_group(sharded_sq) + total_sq
        norm = ops.sqrt(total_sq)
        factor = self.clip_norm / ops.maximum(norm, self.clip_norm)
        return MAP(ops.partial(scale_by, factor[0]), grads)


def _states(state: ZeroState, optimizer, weights):
    """The store of the optimizer's states (:mod:`mindzero.engine.states`), holding the update's Cells, whose
    collectives all come from one :class:`~mindzero.comm.cells.UpdateCollectives`: chained through ``state.order``
    where the step is ordered (``state.ordered``), the one place that decides it."""
    collectives = UpdateCollectives(state.world, state.order if state.ordered else None)
    write_back = WriteBack(state, collectives) if state.gather or state.broadcasts or state.masters_of(CAST) else None
    tail = UpdateTail(write_back, state.ema, weights)
    if state.offload is not None:
        return DiskStates(state.offload, state.layout, state.config.gradient_accumulation_steps > 1, tail)
    owned = any(u.mode == OWNER for u in state.updates)
    return InMemoryStates(state.layout, optimizer, tail, OwnerGradients(state, collectives) if owned else None)

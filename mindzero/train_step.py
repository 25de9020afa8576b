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
7. unless the step overflowed (and ``drop_overflow_update``), the optimizer
   updates its parameters (shards from stage 1 on); stages 1-2 then
   all-gather every updated master shard into the full network parameter.

Returns ``(loss, overflow, loss_scale)`` like ``nn.TrainOneStepWithLossScaleCell``;
``loss`` is this rank's local loss of the micro-batch.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from .comm import (AllReduceSum, AnyRank, FusedAllGather, FusedReduceScatterSum, World, flat_concat,
                   own_shard)


class Identity(nn.Cell):
    def construct(self, x):
        return x


class SumAllReduce(nn.Cell):
    """Sum over the world of full gradients, one all-reduce for the bucket (the train step divides by
    the world size once, with the loss scale)."""

    def __init__(self, specs, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world, "world")
        self.shapes = tuple(tuple(s.shape) for s in specs)
        self.sizes = tuple(s.numel for s in specs)

    def construct(self, grads):
        if len(self.shapes) == 1:
            return (self.sum(grads[0]),)
        parts = ops.split(self.sum(flat_concat(grads)), self.sizes)
        out = ()
        for i in range(len(self.shapes)):
            out = out + (parts[i].reshape(self.shapes[i]),)
        return out


def SumReduceScatter(specs, world: World):
    """Sum over the world of full local gradients, keeping this rank's padded 1D shard of each
    (one reduce-scatter for the bucket)."""
    return FusedReduceScatterSum(world, [s.numel for s in specs], [s.padding for s in specs])


class Reduction(nn.Cell):
    """Apply bucket reducers to a tuple of gradients: ``units`` are ``(positions, cell)``; ``cell`` takes the
    gradients at ``positions`` (a tuple) and returns as many; other positions pass through. With ``scale``
    every output is multiplied by ``factor`` right after its collective (as ``DistributedGradReducer``
    does with the mean), so no second full copy of the gradients is made later."""

    def __init__(self, n: int, units, scale: bool = False):
        super().__init__(auto_prefix=False)
        self.scale = scale
        self.reducers = nn.CellList([cell for _, cell in units])
        self.positions = tuple(tuple(pos) for pos, _ in units)
        source = [-1] * n  # where gradient i is in the reducers' concatenated outputs (-1: passes through)
        for j, i in enumerate(i for pos in self.positions for i in pos):
            source[i] = j
        self.source = tuple(source)
        self.n = n

    def construct(self, grads, factor):
        reduced = ()
        for u in range(len(self.positions)):
            picked = ()
            for i in self.positions[u]:
                picked = picked + (grads[i],)
            reduced = reduced + self.reducers[u](picked)
        result = ()
        for i in range(self.n):
            j = self.source[i]
            g = grads[i] if j < 0 else reduced[j]
            if self.scale:
                g = g * ops.cast(factor, g.dtype)
            result = result + (g,)
        return result


class OwnSlice(nn.Cell):
    """This rank's padded shard of a full gradient (no communication): the part of the
    global norm this rank sums at stage 0, so every stage sums the same numbers in the same order."""

    def __init__(self, padding: int, world: World):
        super().__init__(auto_prefix=False)
        self.padding = padding
        self.rank = world.rank
        self.group_size = world.group_size

    def construct(self, grad):
        return own_shard(grad.reshape((-1,)), self.padding, self.rank, self.group_size)


class GatherInto(nn.Cell):
    """Stages 1-2: all-gather a bucket of updated master shards and write each into its full network
    parameter (one all-gather per bucket)."""

    def __init__(self, specs, world: World):
        super().__init__(auto_prefix=False)
        self.gather = FusedAllGather(world, [s.shard_size for s in specs])
        self.numels = tuple(s.numel for s in specs)
        self.shapes = tuple(tuple(s.shape) for s in specs)

    def construct(self, full_params, shards):
        values = self.gather(shards)
        done = ()
        for i in range(len(self.numels)):
            value = values[i]
            if value.shape[0] != self.numels[i]:  # drop the padding
                value = value[:self.numels[i]]
            done = done + (ops.assign(full_params[i], value.reshape(self.shapes[i])),)
        return done


class ZeroEMA(nn.Cell):
    """Exponential moving average of the optimizer's parameters, held like them: full at stages 0-2,
    shards at stage 3 (named ``ema.<parameter>``, as mindone's ``EMA``).

    After each update ``ema = d * ema + (1 - d) * param`` with mindone's warm-up
    ``d = decay * (1 - exp(-updates / 2000))``; a step skipped for overflow leaves the EMA and
    ``updates`` unchanged.
    """

    def __init__(self, weights, decay: float, updates: int):
        super().__init__(auto_prefix=False)
        self.ema_weights = ParameterTuple([Parameter(Tensor(w.asnumpy().copy(), w.dtype), name="ema." + w.name,
                                                     requires_grad=False) for w in weights])
        self.updates = Parameter(Tensor(float(updates), ms.float32), name="ema_updates", requires_grad=False)
        self.decay = float(decay)

    def construct(self, weights, skipped):
        keep = ops.cast(skipped, ms.float32)
        updates = self.updates + (1.0 - keep)
        d = self.decay * (1.0 - ops.exp(-updates / 2000.0))
        d = keep + (1.0 - keep) * d  # 1 on a skipped step: the EMA stays as it is
        done = (ops.assign(self.updates, updates),)
        for i in range(len(self.ema_weights)):
            ema = self.ema_weights[i]
            w = ops.cast(weights[i], ema.dtype)
            factor = ops.cast(d, ema.dtype)
            done = done + (ops.assign(ema, ema * factor + w * (1.0 - factor)),)
        return done


def map_cells(cells, values):
    """Graph-mode map: ``(cells[0](values[0]), cells[1](values[1]), ...)``."""
    out = ()
    for i in range(len(values)):
        out = out + (cells[i](values[i]),)
    return out


class ZeroTrainOneStepCell(nn.Cell):
    """Train step of :func:`mindzero.prepare_train_network`; see the module docstring for the phases.

    Built by ``prepare_train_network``, which prepares the pieces (shards, reducers,
    optimizer re-pointing); this Cell only orders them.
    """

    def __init__(self, network, optimizer, weights, micro, boundary, norm_slicers,
                 norm_sharded_flags, gather_units, full_params, master_shards, accum_buffers, scale_sense, manager,
                 config, world, ema=None):
        super().__init__(auto_prefix=False)
        self.network = network
        self.network.set_grad()
        self.optimizer = optimizer
        self.weights = ParameterTuple(weights)
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.micro = micro  # Reduction: stage 2's reduce-scatter of each micro-step's gradients
        self.boundary = boundary  # Reduction: the reductions at the accumulation boundary
        self.norm_slicers = nn.CellList(norm_slicers)
        self.sharded_idx = tuple(i for i, s in enumerate(norm_sharded_flags) if s)
        self.replicated_idx = tuple(i for i, s in enumerate(norm_sharded_flags) if not s)
        self.gathers = nn.CellList([cell for _, cell in gather_units])
        self.gather_positions = tuple(tuple(pos) for pos, _ in gather_units)
        self.gather_after_step = len(gather_units) > 0
        if self.gather_after_step:
            self.full_params = ParameterTuple(full_params)
            self.master_shards = ParameterTuple(master_shards)
        self.accum_steps = config.gradient_accumulation_steps
        self.world_size = world.world_size
        if self.accum_steps > 1:
            self.accum_buffers = ParameterTuple(accum_buffers)
            self.micro_step = Parameter(Tensor(0, ms.int32), name="zero_micro_step", requires_grad=False)
        self.scale_sense = scale_sense
        self.has_manager = manager is not None
        if self.has_manager:
            self.loss_scaling_manager = manager
        self.drop_overflow_update = config.drop_overflow_update
        self.clip_grad = config.clip_grad
        self.clip_norm = float(config.clip_norm)
        self.any_rank = AnyRank(world)
        self.sum_over_group = AllReduceSum(world, "op")  # each shard once, not once per replica
        self.has_ema = ema is not None
        if self.has_ema:
            self.ema = ema
        self.set_train(True)

    def construct(self, *inputs):
        scale = self.scale_sense * 1.0
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, ops.cast(scale, loss.dtype))
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.micro(grads, scale)  # (no scaling here: the factor is applied once, at the boundary)
        if self.accum_steps == 1:
            overflow = self._apply(grads, scale)
        else:
            step = ops.depend(self.micro_step + 1, self._accumulate(grads))
            ops.assign(self.micro_step, step)
            overflow = ops.zeros((), ms.bool_)
            if step % self.accum_steps == 0:
                grads = tuple(ops.depend(buf, step) for buf in self.accum_buffers)
                overflow = self._apply(grads, scale)
                self._zero_buffers(overflow)
        return loss, overflow, scale

    def _accumulate(self, grads):
        done = ()
        for i in range(len(grads)):
            done = done + (ops.assign_add(self.accum_buffers[i], grads[i]),)
        return done

    def _zero_buffers(self, after):
        for i in range(len(self.accum_buffers)):
            buf = self.accum_buffers[i]
            ops.assign(buf, ops.depend(ops.zeros_like(buf), after))

    def _apply(self, grads, scale):
        # every reduction is a sum over the world: one multiply by 1 / (loss_scale * K * N), right after each
        # collective, makes the sums means of the unscaled gradients
        inv = ops.reciprocal(ops.cast(scale, ms.float32) * (self.accum_steps * self.world_size))
        grads = self.boundary(grads, inv)
        overflow = self.any_rank(ops.logical_not(self._all_finite(grads)))
        if self.has_manager:
            overflow = self.loss_scaling_manager(self.scale_sense, overflow)
        if self.clip_grad:
            grads = self._clip(grads)
        if self.drop_overflow_update:
            if not overflow:
                overflow = ops.depend(overflow, self.optimizer(grads))
        else:
            overflow = ops.depend(overflow, self.optimizer(grads))
        if self.gather_after_step:
            # Outside the overflow branch: there, MindSpore 2.10 (CPU) dropped the last
            # of a chain of assigns. On a skipped step the gather rewrites the same values.
            overflow = self._gather_params(overflow)
        if self.has_ema:  # after the gather, so stages 1-2 average the updated full parameters
            skipped = overflow if self.drop_overflow_update else ops.zeros((), ms.bool_)
            overflow = ops.depend(overflow, self.ema(self.weights, skipped))
        return overflow

    def _all_finite(self, grads):
        flags = ()
        for g in grads:
            flags = flags + (ops.isfinite(g).all(),)
        return ops.stack(flags).all()

    def _clip(self, grads):
        """Scale every gradient by ``clip_norm / max(global_norm, clip_norm)``.

        The norm is canonical: whatever the stage, each rank sums the squares of the
        slices the partition plan gives it, one all-reduce adds them, and replicated
        gradients are added once. Every stage therefore gets the same clip factor to
        the bit (a plain full-tensor norm would differ from the sharded one in rounding).
        """
        sharded_sq = ops.zeros((1,), ms.float32)
        for i in self.sharded_idx:
            part = self.norm_slicers[i](grads[i])
            sharded_sq = sharded_sq + ops.reduce_sum(ops.square(ops.cast(part, ms.float32)))
        if len(self.sharded_idx) > 0:
            sharded_sq = self.sum_over_group(sharded_sq)
        total_sq = sharded_sq
        for i in self.replicated_idx:
            total_sq = total_sq + ops.reduce_sum(ops.square(ops.cast(grads[i], ms.float32)))
        norm = ops.sqrt(total_sq)
        factor = self.clip_norm / ops.maximum(norm, self.clip_norm)
        return tuple(g * ops.cast(factor[0], g.dtype) for g in grads)

    def _gather_params(self, after):
        """Stages 1-2: all-gather every master shard into its full parameter (one collective per bucket),
        after ``after``."""
        for u in range(len(self.gathers)):
            fulls, shards = (), ()
            for i in self.gather_positions[u]:
                fulls = fulls + (self.full_params[i],)
                shards = shards + (ops.depend(self.master_shards[i], after),)
            after = ops.depend(after, self.gathers[u](fulls, shards))
        return after

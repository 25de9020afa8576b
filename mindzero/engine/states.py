"""Where the optimizer's states live, behind one interface: the train step, :func:`mindzero.memory_report` and
checkpoints read and write them through it, whatever the store.

A store is a child Cell of the train step (``train_step.states``), a :class:`StateStore` with:

- ``construct(grads, after) -> after``: in the step's graph, inside the update's branch (the update is due and not
  skipped for overflow), after the masters' refresh: what the update does with the reduced gradients;
- ``settle(skipped, overflow) -> overflow``: in the graph at every update step (every ``K``-th call), skipped or not;
- ``handoff(due, skipped, grads) -> output``: at the end of every step's graph, told whether it was an update step
  and whether its update was skipped for overflow: what the graph gives the store beyond ``(loss, overflow,
  loss_scale)`` (the step's fourth output, never the user's);
- ``after_step(handoff)``: in Python, after the graph;
- ``state(attr, index)``: optimizer parameter ``index``'s state ``attr`` as checkpoints read and load it;
- ``scratch``: its Parameters that are no checkpoint entry;
- ``bytes()``: what it holds, by kind (``memory_report``), and ``describe()``: a line for the report, or ``None``;
- ``tail``: its :class:`UpdateTail`, the write-back and the EMA after the update, the same Cell for every store.

:class:`InMemoryStates`: the states are the optimizer's Parameters and the update is the graph's.
:class:`~mindzero.engine.offload.DiskStates` (``optimizer_offload="disk"``): the states are in a file and the update
streams them after the graph.
"""
from __future__ import annotations

from mindspore import nn, ops

from .kernels import MAP, depend_on
from .repoint import optimizer_state_params


def nbytes(tensor) -> int:
    return int(tensor.nbytes)


class UpdateTail(nn.Cell):
    """What follows the optimizer's update, whatever the store: the write-back (``write_back``: stages 1-2 gather
    the updated master shards, owners broadcast, ``param_dtype`` masters are cast back; only where the update ran)
    and the EMA (``ema`` of ``weights``, at every update step, skipped or not: a skipped one leaves it as it is).
    The in-memory store runs :meth:`write` inside the update's branch and :meth:`average` at every update step; the
    disk store runs both after its streamed update (``construct``)."""

    def __init__(self, write_back=None, ema=None, weights=None):
        super().__init__(auto_prefix=False)
        self.has_write_back, self.has_ema = write_back is not None, ema is not None
        if self.has_write_back:
            self.write_back = write_back
        if self.has_ema:
            self.ema, self.weights = ema, weights

    @property
    def empty(self) -> bool:
        return not (self.has_write_back or self.has_ema)

    def write(self, after):
        """The write-back after ``after``; returns ``after`` made to depend on it."""
        if self.has_write_back:
            return self.write_back(after)
        return after

    def average(self, skipped, after):
        """The EMA after the write-back (stages 1-2 average the updated full parameters); returns ``after`` made
        to depend on it."""
        if self.has_ema:
            return ops.depend(after, self.ema(self.weights, skipped))
        return after

    def construct(self, skipped):
        after = skipped
        if not skipped:
            after = self.write(after)
        return self.average(skipped, after)


class StateStore(nn.Cell):
    """The base of every store of the optimizer's states (the interface: the module note); ``tail``: its
    :class:`UpdateTail`. A store defines ``construct``, ``state`` and ``bytes``; the defaults here are those of a
    store whose update is the graph's."""

    def __init__(self, tail: UpdateTail):
        super().__init__(auto_prefix=False)
        self.tail = tail
        self.scratch = ()

    def settle(self, skipped, overflow):
        return overflow

    def handoff(self, due, skipped, grads):
        return ()

    def after_step(self, handoff) -> None:
        return None

    def describe(self):
        return None


class InMemoryStates(StateStore):
    """The optimizer's states are its own Parameters: the update runs in the step's graph, the owner-mode gradients
    handed over first (``owner_grads``), the tail's write-back after it in the same branch, its EMA at every update
    step, skipped or not. Holds the train step's own Cells."""

    def __init__(self, layout, optimizer, tail: UpdateTail, owner_grads=None):
        super().__init__(tail)
        self.layout = layout
        self.optimizer = optimizer
        self.has_owner_grads = owner_grads is not None
        if self.has_owner_grads:
            self.owner_grads = owner_grads

    def construct(self, grads, after):
        grads = MAP(ops.partial(depend_on, after), grads)
        if self.has_owner_grads:
            grads = self.owner_grads(grads)
        after = ops.depend(after, self.optimizer(grads))
        return self.tail.write(after)

    def settle(self, skipped, overflow):
        return self.tail.average(skipped, overflow)

    def state(self, attr, index):
        return self.layout.states[attr][index]

    def bytes(self) -> dict:
        return {"optimizer_moments": sum(nbytes(p) for p in optimizer_state_params(self.layout)), "gradients": 0}


__all__ = ["InMemoryStates", "StateStore", "UpdateTail", "nbytes"]

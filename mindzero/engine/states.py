"""Where the optimizer's states live, behind one interface: the train step, :func:`mindzero.memory_report` and
checkpoints read and write them through it, whatever the store.

A store is a child Cell of the train step (``train_step.states``) with:

- ``construct(grads, after) -> after``: in the step's graph, inside the update's branch (the update is due and not
  skipped for overflow), after the masters' refresh: what the update does with the reduced gradients;
- ``settle(skipped, overflow) -> overflow``: in the graph at every update step (every ``K``-th call), skipped or not;
- ``handoff(due, skipped, grads) -> output``: at the end of every step's graph, told whether it was an update step
  and whether its update was skipped for overflow: what the graph gives the store beyond ``(loss, overflow,
  loss_scale)`` (the step's fourth output, never the user's);
- ``after_step(handoff)``: in Python, after the graph;
- ``state(attr, index)``: optimizer parameter ``index``'s state ``attr`` as checkpoints read and load it;
- ``scratch``: its Parameters that are no checkpoint entry;
- ``bytes()``: what it holds, by kind (``memory_report``), and ``describe()``: a line for the report, or ``None``.

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


class InMemoryStates(nn.Cell):
    """The optimizer's states are its own Parameters: the update runs in the step's graph, the owner-mode gradients
    gathered first (``owner_grads``), the write-back (``write_back``) after it in the same branch, the EMA
    (``ema`` of ``weights``) at every update step, skipped or not. Holds the train step's own Cells."""

    def __init__(self, layout, optimizer, owner_grads=None, write_back=None, ema=None, weights=None):
        super().__init__(auto_prefix=False)
        self.layout = layout
        self.optimizer = optimizer
        self.has_owner_grads, self.has_write_back, self.has_ema = (owner_grads is not None, write_back is not None,
                                                                   ema is not None)
        if self.has_owner_grads:
            self.owner_grads = owner_grads
        if self.has_write_back:
            self.write_back = write_back
        if self.has_ema:
            self.ema, self.weights = ema, weights
        self.scratch = ()

    def construct(self, grads, after):
        grads = MAP(ops.partial(depend_on, after), grads)
        if self.has_owner_grads:
            grads = self.owner_grads(grads)
        after = ops.depend(after, self.optimizer(grads))
        if self.has_write_back:
            after = self.write_back(after)
        return after

    def settle(self, skipped, overflow):
        if self.has_ema:  # after the write-back, so stages 1-2 average the updated full parameters
            overflow = ops.depend(overflow, self.ema(self.weights, skipped))
        return overflow

    def handoff(self, due, skipped, grads):
        return ()

    def after_step(self, handoff) -> None:
        return None

    def state(self, attr, index):
        return self.layout.states[attr][index]

    def bytes(self) -> dict:
        return {"optimizer_moments": sum(nbytes(p) for p in optimizer_state_params(self.layout)), "gradients": 0}

    def describe(self):
        return None


__all__ = ["InMemoryStates", "nbytes"]

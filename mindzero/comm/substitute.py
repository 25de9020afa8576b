"""Test-only: the GPU/Ascend group primitives as CPU-legal graph functions with their semantics
(:class:`mindzero.comm.backends.Substituted`, :func:`mindzero.comm.substitute_collectives`)."""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

from ..core.topology import World
from .quantize import bytes_to_words, words_to_bytes


def substitute_primitive(kind: str, world: World, ranks: tuple):
    """A CPU-legal graph-mode function with the semantics of ``kind`` over the group of world ``ranks``:
    every rank's tensor by one world all-gather, the group's rows taken in group order, summed in that order."""
    gather, take = ops.AllGather(world.world_group), ops.Gather()
    rows, size, index = world.world_size, len(ranks), ranks.index(world.world_rank)
    members = Tensor(list(ranks), ms.int32)

    def of_group(x):  # (size, x.size): every member's x, in group order
        return take(gather(x.reshape((-1,))).reshape((rows, -1)), members, 0)

    def total(parts):
        acc = parts[0]
        for k in range(1, size):
            acc = acc + parts[k]
        return acc

    def all_gather(x):
        if x.dtype == ms.int8:  # no int8 all-gather on CPU: the same bytes travel as int32 words
            words = of_group(bytes_to_words(ops.cast(x, ms.int32))).reshape((-1,))
            return ops.cast(words_to_bytes(words), ms.int8)
        return of_group(x).reshape((-1,))

    def all_reduce(x):
        return total(of_group(x)).reshape(x.shape)

    def reduce_scatter(x):
        return total(of_group(x)).reshape((size, -1))[index]

    return {"all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter}[kind]

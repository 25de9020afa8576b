"""Graph-mode layout helpers of the flat 1D shard layout: this rank's shard of a tensor, tuples picked and
flattened, a tensor laid out as one row per op rank. The collective Cells (:mod:`mindzero.comm.cells`,
:mod:`mindzero.comm.backends`) and the train step's kernels (:mod:`mindzero.engine.kernels`) share them.

``MAP`` is mindzero's one ``ops.Map``: per-tensor work is a ``MultitypeFuncGraph`` kernel mapped over tuples
of tensors (MindSpore's idiom, ``nn/wrap/grad_reducer.py``), never a tuple grown one element at a time.
"""
from __future__ import annotations

from mindspore import ops

MAP = ops.Map()

# Slices in graph code are written as Tensor indexing (``x[a:b]``), inline: MindSpore builds the ``StridedSlice``
# from it in C++ (a meta graph), where a call of an ``ops.StridedSlice()`` instance goes through the primitive's
# argument conversion at every call site and takes about 1.7 times as long to compile, type inference most of it
# (benchmarks/compile_floor.py's cut-primitive and cut-index; docs/performance.md). A Python helper wrapping the
# indexing would be parsed once more per call site.


class _TupleItem(type(ops.tuple_getitem)):
    """MindSpore's ``TupleGetItem`` primitive in graph code; PyNative, which cannot run it eagerly, indexes."""

    def __call__(self, values, i):
        return values[i]


#: ``GETITEM(values, i)``: ``values[i]`` of a tuple by the ``TupleGetItem`` primitive: indexing a tuple
#: (``values[i]``) is parsed into a function graph per call site
GETITEM = _TupleItem("TupleGetItem")


def own_shard(flat, padding: int, op_rank: int, op_size: int):
    """``flat`` zero-padded by ``padding``, then op rank ``op_rank``'s contiguous 1/``op_size`` (the graph
    twin of :func:`mindzero.core.plan.shard_of_flat`).

    Pads the whole tensor before slicing: slicing a collective's output first and padding the tail made
    MindSpore's CPU all-reduce write into a buffer of the slice's size ("RunRingAllReduce Memcpy
    error"). Without padding or sharding the tensor is returned as it is.
    """
    if padding:
        flat = ops.concat((flat, ops.zeros((padding,), flat.dtype)))
    if op_size == 1:
        return flat
    size = flat.shape[0] // op_size
    return flat[op_rank * size:(op_rank + 1) * size]


# --- tuples and buckets ------------------------------------------------------------------------------------
flatten = ops.MultitypeFuncGraph("mindzero_flatten")
item = ops.MultitypeFuncGraph("mindzero_item")
flat_item = ops.MultitypeFuncGraph("mindzero_flat_item")
own_part = ops.MultitypeFuncGraph("mindzero_own_part")
as_rows = ops.MultitypeFuncGraph("mindzero_as_rows")
reshape_as = ops.MultitypeFuncGraph("mindzero_reshape_as")
piece = ops.MultitypeFuncGraph("mindzero_piece")
column = ops.MultitypeFuncGraph("mindzero_column")


@flatten.register("Tensor")
def _flatten(x):
    """``x`` as 1D."""
    return x.reshape((-1,))


@item.register("Tuple", "Number")
def _item(values, i):
    """``values[i]``."""
    return GETITEM(values, i)


@flat_item.register("Tuple", "Number")
def _flat_item(values, i):
    """``values[i]`` as 1D."""
    return GETITEM(values, i).reshape((-1,))


@own_part.register("Tensor", "Number", "Number", "Number", "Number", "Number")
def _own_part(flat, op_rank, op_size, offset, numel, padding):
    """This rank's padded shard of the tensor at ``[offset, offset + numel)`` of a concatenation."""
    return own_shard(flat[offset:offset + numel], padding, op_rank, op_size)


@as_rows.register("Number", "Tensor", "Number")
def _as_rows(op_size, x, padding):
    """``x`` flattened, zero-padded and laid out as ``(op_size, shard_size)``: row ``r`` is op rank ``r``'s shard."""
    return own_shard(x.reshape((-1,)), padding, 0, 1).reshape((op_size, -1))


@piece.register("Tensor", "Number", "Number")
def _piece(x, offset, size):
    """``x[offset:offset + size]`` of a 1D ``x``: one member of a fused bucket's concatenation. Mapped over the
    members (``ops.split`` with many sections unrolled recursively in MindSpore's graph mode: a bucket of 115
    tensors passed its call-depth limit of 1000)."""
    return x[offset:offset + size]


@column.register("Tensor", "Number", "Number")
def _column(x, offset, size):
    """Columns ``[offset, offset + size)`` of a 2D ``x``, flat."""
    return x[:, offset:offset + size].reshape((-1,))


@reshape_as.register("Tensor", "Tensor")
def _reshape_as(part, like):
    """``part`` in ``like``'s shape."""
    return part.reshape(like.shape)


def pieces(x, offsets, sizes):
    """A 1D ``x`` cut into the pieces ``[offsets[i], offsets[i] + sizes[i])`` (tuples of ints)."""
    return MAP(ops.partial(piece, x), offsets, sizes)


def column_pieces(x, offsets, sizes):
    """A 2D ``x`` cut into the column ranges ``[offsets[i], offsets[i] + sizes[i])``, each flat."""
    return MAP(ops.partial(column, x), offsets, sizes)


def pick(values, positions):
    """``(values[positions[0]], values[positions[1]], ...)``."""
    return MAP(ops.partial(item, values), positions)


def flat_pick(values, positions):
    """``values[positions[0]], values[positions[1]], ...`` flattened and concatenated (at least two positions): one
    kernel call a tensor, where :func:`pick` then :func:`flat_concat` make two."""
    return ops.concat(MAP(ops.partial(flat_item, values), positions))


def flat_concat(tensors):
    """The tensors flattened and concatenated (no copy for one tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape((-1,))
    return ops.concat(MAP(flatten, tensors))

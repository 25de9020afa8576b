"""Cross-rank checks before training: every rank built the same plan, the same optimizer and the same initial
values.

Ranks that disagree would deadlock in mismatched collectives or train different replicas; each check here
costs one small all-gather and fails on every rank with the same message.
"""
from __future__ import annotations

import hashlib

import numpy as np
from mindspore import Tensor

from ..comm.cells import AllGather, shared_cell
from ..core.checksum import crc32_array
from ..core.plan import PartitionPlan
from ..core.topology import World


def _digits(text: str, n: int) -> list:
    """``n`` 24-bit pieces of a hex digest (exact in float32, the dtype every backend all-gathers)."""
    return [float(int(text[6 * i:6 * i + 6], 16)) for i in range(n)]


def check_same_plan(plan: PartitionPlan, world: World, stage: int) -> None:
    """Fail with a message naming the first difference unless every rank built the same plan and stage.

    Communication: one all-gather of 5 numbers per rank; on a mismatch, one more of one number per
    parameter to locate it. Ranks that disagree would otherwise deadlock in mismatched collectives.

    Raises:
        ValueError: naming this rank, the differing rank and the first differing parameter.
    """
    if world.world_size == 1:
        return
    rows = _rows_of_all_ranks(world, [float(len(plan)), float(stage)] + _digits(plan.fingerprint(), 3))
    bad = [r for r in range(world.world_size) if not np.array_equal(rows[r], rows[0])]
    if not bad:
        return
    other = bad[0]
    if rows[other][1] != rows[0][1]:
        raise ValueError(f"rank {world.world_rank}: zero_stage differs across ranks (rank 0: {int(rows[0][1])}, "
                         f"rank {other}: {int(rows[other][1])}); every rank must prepare the same stage")
    if rows[other][0] != rows[0][0]:
        raise ValueError(f"rank {world.world_rank}: the networks differ across ranks: rank 0 has {int(rows[0][0])} "
                         f"parameters, rank {other} has {int(rows[other][0])}; this rank has {len(plan)}")
    per = [_digits(hashlib.sha256(repr((s.name, s.shape, s.dtype, s.sharded)).encode()).hexdigest(), 1)[0]
           for s in plan]
    table = _rows_of_all_ranks(world, per)
    index = int(np.argmax(table[other] != table[0]))
    spec = plan.specs[index]
    raise ValueError(f"rank {world.world_rank}: the networks differ across ranks at parameter #{index}: on this rank "
                     f"{spec.name!r} {spec.shape} {spec.dtype}, and rank {other} differs from rank 0 there; "
                     "every rank must build the same network and optimizer")


def _rows_of_all_ranks(world: World, row: list):
    """``row`` (floats, exact in float32) from every rank: a ``(world_size, len(row))`` numpy array."""
    gathered = shared_cell(AllGather, world, "world")(Tensor(np.array(row, np.float32)))
    return gathered.asnumpy().reshape(world.world_size, -1)


def check_same_values(plan: PartitionPlan, digests: dict, world: World) -> None:
    """Fail unless every rank computed the same full values (``digests``: name -> CRC32 of the full
    tensor, for the tensors prepare materialised or sharded).

    Communication: one all-gather of two numbers per parameter. Ranks built with different seeds would
    otherwise train different replicas (stages 0-2) or a model stitched from different initialisations.

    Raises:
        ValueError: naming the first parameter whose values differ and the rank.
    """
    if world.world_size == 1:
        return
    row = []
    for s in plan:
        crc = digests.get(s.name, -1)
        row += [-1.0, -1.0] if crc < 0 else [float(crc >> 16), float(crc & 0xFFFF)]  # exact in float32
    table = _rows_of_all_ranks(world, row)
    bad = [r for r in range(world.world_size) if not np.array_equal(table[r], table[0])]
    if bad:
        index = int(np.argmax(np.any(table[bad[0]].reshape(-1, 2) != table[0].reshape(-1, 2), axis=1)))
        raise ValueError(f"rank {world.world_rank}: the initial values of parameter {plan.specs[index].name!r} differ "
                         f"between rank 0 and rank {bad[0]}; every rank must build the same network with the same "
                         "seed (call mindspore.set_seed(...) with one value on every rank before building it)")


def describe_optimizer(layout, params) -> list:
    """``[(what, text)]``: everything every rank's optimizer must agree on, each as deterministic text: its class,
    each hyper-parameter attribute (numbers and flags as written, tensors and shared scalars by dtype, shape and
    CRC-32 of their values, per-parameter entries entry by entry, a torch-style optimizer's parameter groups without
    their parameters), each parameter's states (shapes, dtypes) and how its update is shared out (mode, owner)."""
    from mindspore import Parameter, Tensor, nn

    opt = layout.optimizer
    skip = set(layout.aliases) | set(layout.states) | set(vars(nn.Cell(auto_prefix=False)))
    names = {id(p): p.name for p in layout.params}

    def text(value, depth=3):
        if isinstance(value, (bool, int, float, str, type(None))):
            return repr(value)
        if id(value) in names:
            return f"<parameter {names[id(value)]}>"
        if isinstance(value, (Tensor, Parameter)):
            array = value.asnumpy()
            if array.size <= 8:  # a learning rate, a beta, a step: its values, as the message names them
                return f"{array.dtype}{array.reshape(-1).tolist()}"
            return f"<{array.dtype}{tuple(array.shape)} crc {crc32_array(array)}>"
        if depth == 0:
            return f"<{type(value).__name__}>"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {text(v, depth - 1)}" for k, v in value.items() if k not in layout.states) \
                + "}"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(text(v, depth - 1) for v in value) + "]"
        if isinstance(value, nn.Cell):
            return f"<{type(value).__name__} {text([p for p in value.get_parameters()], depth - 1)}>"
        if hasattr(value, "attrs") and hasattr(value, "name"):  # a primitive: its name and attributes
            return f"<{value.name} {sorted((k, repr(v)) for k, v in value.attrs.items())}>"
        return f"<{type(value).__module__}.{type(value).__qualname__}>"

    out = [("class", f"{type(opt).__module__}.{type(opt).__qualname__}")]
    attributes = {key: value for key, value in vars(opt).items() if key not in skip and not key.startswith("__")}
    attributes.update(layout.scalars)  # learning rates, betas, step counters: Parameters a Cell keeps in _params
    out += [(f"attribute {key!r}", text(value)) for key, value in sorted(attributes.items())]
    for ps in params:
        u = ps.update
        out.append((f"parameter {ps.name!r}", f"{u.mode} owner {u.owner} states "
                                              f"{[(s.attr, s.shape, s.dtype) for s in u.states]}"))
    return out


TEXT_CHARS = 60  # characters of a differing value each rank shares to name it


def check_same_optimizer(layout, params, world: World) -> None:
    """Fail on every rank unless every rank's optimizer is the same: class, hyper-parameters, parameter groups,
    states and how each parameter's update is shared out (:func:`describe_optimizer`).

    Communication: one all-gather of 4 numbers per rank; on a mismatch, one of one number per item to locate it
    and one of its text to name both values.

    Raises:
        ValueError: naming the differing item, this rank's value and the first differing rank's.
    """
    if world.world_size == 1:
        return
    items = describe_optimizer(layout, params)
    whole = hashlib.sha256(repr(items).encode()).hexdigest()
    rows = _rows_of_all_ranks(world, [float(len(items))] + _digits(whole, 3))
    bad = [r for r in range(world.world_size) if not np.array_equal(rows[r], rows[0])]
    if not bad:
        return
    other = bad[0]
    width = int(rows[:, 0].max())
    per = [_digits(hashlib.sha256(repr(item).encode()).hexdigest(), 1)[0] for item in items]
    table = _rows_of_all_ranks(world, per + [-1.0] * (width - len(per)))
    index = int(np.argmax(table[other] != table[0]))
    what, mine = items[min(index, len(items) - 1)]
    codes = [float(ord(c) % 65536) for c in mine[:TEXT_CHARS]]
    texts = _rows_of_all_ranks(world, codes + [0.0] * (TEXT_CHARS - len(codes)))

    def decoded(r):
        return "".join(chr(int(c)) for c in texts[r] if c) + ("..." if len(mine) > TEXT_CHARS else "")

    raise ValueError(f"rank {world.world_rank}: the optimizers differ across ranks: {what} is {decoded(0)} on rank 0 "
                     f"and {decoded(other)} on rank {other}; every rank must build the same optimizer (class, "
                     "hyper-parameters and parameter groups)")

"""Cross-rank checks before training: every rank built the same plan, the same optimizer and the same initial
values.

Ranks that disagree would deadlock in mismatched collectives or train different replicas; each check here
costs one small all-gather and fails on every rank with the same message.
"""
from __future__ import annotations

import hashlib

import numpy as np
from mindspore import Tensor

from ..comm.backends import backend_of
from ..core.plan import PartitionPlan
from ..core.topology import BACKENDS, DEVICES, World


def _digits(text: str, n: int) -> list:
    """``n`` 24-bit pieces of a hex digest (exact in float32, the dtype every backend all-gathers)."""
    return [float(int(text[6 * i:6 * i + 6], 16)) for i in range(n)]


def check_same_plan(plan: PartitionPlan, world: World, stage: int) -> None:
    """Fail with a message naming the first difference unless every rank runs on the same device and collective
    backend and built the same plan and stage.

    Communication: one all-gather of 7 numbers per rank; on a mismatch, one more of one number per
    parameter to locate it. Ranks that disagree would otherwise deadlock in mismatched collectives.

    Raises:
        ValueError: naming every rank's device (or backend) where they differ; else this rank, the differing rank
            and the first differing parameter.
    """
    if world.world_size == 1:
        return
    rows = _rows_of_all_ranks(world, [float(len(plan)), float(stage), float(_code(DEVICES, world.device)),
                                      float(_code(BACKENDS, world.backend))] + _digits(plan.fingerprint(), 3))
    bad = [r for r in range(world.world_size) if not np.array_equal(rows[r], rows[0])]
    if not bad:
        return
    other = bad[0]
    for column, what, names, remedy in (
            (2, "device", DEVICES, "set it the same way on each (mindspore.set_device, or "
                                   "start_data_parallel(device=...) / MINDZERO_DEVICE)"),
            (3, "collective backend", BACKENDS, "turn the test-only substitute (MINDZERO_SUBSTITUTE_COLLECTIVES=1, "
                                                "substitute_collectives()) on for all ranks or for none")):
        if rows[other][column] != rows[0][column]:
            on = ", ".join(f"rank {r} on {_name(names, rows[r][column])}" for r in range(world.world_size))
            raise ValueError(f"rank {world.world_rank}: the ranks run on different {what}s ({on}); every rank must "
                             f"run on the same {what}: {remedy}")
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


def _code(names: tuple, name: str) -> int:
    """``name``'s index in ``names`` (a device or a backend, shared as a number), ``len(names)`` if unknown."""
    return names.index(name) if name in names else len(names)


def _name(names: tuple, code: float) -> str:
    return names[int(code)] if int(code) < len(names) else "another"


def _rows_of_all_ranks(world: World, row: list):
    """``row`` (floats, exact in float32) from every rank: a ``(world_size, len(row))`` numpy array (one
    all-gather, called eagerly: no graph compiled for a check)."""
    gathered = backend_of(world).host_gather("world")(Tensor(np.array(row, np.float32)))
    return gathered.reshape(world.world_size, -1)


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
    """``[(what, text)]``: everything every rank's optimizer must agree on, each as deterministic text
    (:meth:`~mindzero.engine.optim.OptimizerLayout.hyper_parameters`: its class, every hyper-parameter attribute and
    shared scalar, its parameter groups without their parameters), then each parameter's states (shapes, dtypes)
    and how its update is shared out (mode, owner)."""
    out = list(layout.hyper_parameters())
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

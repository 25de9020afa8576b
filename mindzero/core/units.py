"""Stage 3's gather units: which parameters share one all-gather (FSDP2 gathers one flat buffer per module it
wraps). Pure: no MindSpore import.

:func:`weight_gathers` is the record of stage 3's weight all-gathers: the train step builds one gather per entry
(:mod:`mindzero.engine.stage3`) and the communication plan counts one per entry (:mod:`mindzero.core.comm_plan`),
so what runs and what is counted come from one list.

A *unit* is a set of sharded parameters whose shards are concatenated and all-gathered in one collective; each
reading Cell then takes its parameter's columns of the gathered ``(ranks, unit shard)`` matrix. Graph mode
merges the identical gathers of a unit's read sites into one (common-subexpression elimination), so the
unit costs one forward gather (and, with ``stage3_regather``, one backward gather) instead of one per
parameter. Gradients are still reduced one parameter at a time, each exactly as without units (MindSpore's
autodiff runs before that merge, so the read sites' backwards cannot meet in one node: docs/performance.md).

``gather_units`` chooses the units:

* ``None`` (default): one gather per parameter;
* an int ``B``: consecutive parameters (in the network's Cell order) up to ``B`` bytes of full tensors per unit
  (a parameter larger than ``B`` is a unit alone): a size rule, as DeepSpeed's and FSDP1's flat buckets;
* a Cell-name pattern or a list of them (``fnmatch``, e.g. ``"blocks.*"``): each Cell whose name matches (the
  outermost one, when nested Cells match) is one unit of the parameters read inside it, as FSDP2 wraps a
  transformer block; parameters read outside every matching Cell keep their own gather.

Only parameters that gather the same way can share a unit: the same held dtype, gathered exactly (a quantized
gather, :mod:`mindzero.core.quant`, keeps its own), read by one Cell (a tied weight keeps its own). A unit of
one parameter is no unit.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable, Optional

from .checks import is_int


@dataclass(frozen=True)
class Read:
    """One sharded parameter as :func:`GatherUnits.group` sees it: its name, the name of the Cell reading it,
    its full bytes, and ``kind``: parameters of different kinds never share a unit (``None``: it shares none)."""

    name: str
    cell: str
    nbytes: int
    kind: Optional[tuple]


@dataclass(frozen=True)
class GatherUnits:
    """``gather_units`` of :func:`mindzero.prepare_train_network` (see the module docstring): ``max_bytes``
    (the size rule) or ``cells`` (Cell-name patterns), exactly one of them."""

    max_bytes: Optional[int] = None
    cells: tuple = ()

    @staticmethod
    def parse(value) -> "Optional[GatherUnits]":
        """``None``, an int of bytes >= 1, a Cell-name pattern, or a list of them.

        Raises:
            ValueError: naming the argument, the value and the rule.
        """
        if value is None or isinstance(value, GatherUnits):
            return value
        if is_int(value):
            if value < 1:
                raise ValueError(f"gather_units as a size must be an int >= 1 (bytes of full parameters per "
                                 f"unit), got {value!r}")
            return GatherUnits(max_bytes=int(value))
        patterns = (value,) if isinstance(value, str) else value
        if not isinstance(patterns, (list, tuple)) or not patterns or \
                not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"gather_units must be None, an int (bytes per unit) or Cell-name patterns (a str or a "
                             f"non-empty list of non-empty str, fnmatch, e.g. 'blocks.*'), got {value!r}")
        return GatherUnits(cells=tuple(patterns))

    def as_setting(self):
        """The value ``parse`` reads back."""
        if self.max_bytes is not None:
            return self.max_bytes
        return self.cells[0] if len(self.cells) == 1 else list(self.cells)

    def unit_cell(self, cell: str) -> Optional[str]:
        """The outermost Cell (a prefix of ``cell``'s dotted name, or ``cell`` itself) matching a pattern."""
        parts = cell.split(".") if cell else []
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if any(fnmatchcase(prefix, p) for p in self.cells):
                return prefix
        return None

    def group(self, reads) -> list:
        """The units of ``reads`` (:class:`Read`, in the network's order): a list of tuples of parameter names,
        each of at least two parameters, in that order. Parameters in no unit are left out."""
        units = []
        if self.max_bytes is not None:
            current, size = [], 0
            for r in reads:
                if r.kind is None:
                    continue
                if current and (current[-1].kind != r.kind or size + r.nbytes > self.max_bytes):
                    units.append(current)
                    current, size = [], 0
                current.append(r)
                size += r.nbytes
            units.append(current)
        else:
            by_cell = {}
            for r in reads:
                owner = self.unit_cell(r.cell)
                if r.kind is not None and owner is not None:
                    by_cell.setdefault((owner, r.kind), []).append(r)
            units = list(by_cell.values())
        return [tuple(r.name for r in unit) for unit in units if len(unit) > 1]


@dataclass(frozen=True)
class WeightGather:
    """One of stage 3's weight all-gathers: ``names``, the parameters whose shards travel in it (one parameter, or a
    unit's members in unit order), and ``quant_block`` (int8 values with an fp32 scale per this many elements,
    :mod:`mindzero.core.quant`; ``None``: the values as held)."""

    names: tuple
    quant_block: Optional[int] = None

    @property
    def unit(self) -> bool:
        """Several parameters in one collective (``gather_units``)."""
        return len(self.names) > 1


def weight_gathers(reads, units: Optional[GatherUnits] = None,
                   quant_block: Callable[[str], Optional[int]] = lambda name: None) -> tuple:
    """The :class:`WeightGather` records of ``reads`` (:class:`Read`: every sharded parameter the network reads,
    once each, in the network's order): a unit's members (``units.group``) share one, at its first member's
    place; every other parameter has its own, quantized where ``quant_block(name)`` gives a block size (a quantized
    parameter is in no unit: its ``Read.kind`` is ``None``)."""
    unit_of = {name: unit for unit in (units.group(reads) if units is not None else []) for name in unit}
    out, done = [], set()
    for r in reads:
        unit = unit_of.get(r.name)
        if unit is None:
            out.append(WeightGather((r.name,), quant_block(r.name)))
        elif unit not in done:
            done.add(unit)
            out.append(WeightGather(unit))
    return tuple(out)

"""The worker side of a launch (:mod:`mindzero.launch.local`): the start every launched script repeats
(its arguments with the ``--out`` the launcher appends, the data-parallel world, this rank's directory) and
the marker the launcher waits for (``out/rank_<world rank>.done``).

The one module of :mod:`mindzero.launch` that runs inside a worker, so the one that imports above
:mod:`mindzero.core`: it starts the world through :func:`mindzero.comm.start.start_data_parallel`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..comm.start import start_data_parallel


@dataclass
class Worker:
    """One rank of a launched script (the worker protocol): its parsed arguments, its :class:`World`, the
    launch's ``out`` directory and its own ``rank_dir`` (``out/rank_<world rank>``, made)."""

    args: argparse.Namespace
    world: object
    out: Path

    @property
    def rank_dir(self) -> Path:
        return self.out / f"rank_{self.world.world_rank}"

    def finish(self) -> None:
        """Tell the launcher this rank finished: ``out/rank_<world rank>.done``."""
        finish_rank(self.out, self.world.world_rank)


def start_worker(parser: argparse.ArgumentParser = None, argv=None, **start) -> Worker:
    """The start of every launched script: parse its arguments (``parser``'s, plus the ``--out`` the
    launcher appends), start the data-parallel world (:func:`mindzero.start_data_parallel` with ``start``)
    and make this rank's directory."""
    parser = parser or argparse.ArgumentParser()
    if not any("--out" in a.option_strings for a in parser._actions):
        parser.add_argument("--out", required=True, help="the launch's output directory (given by the launcher)")
    args = parser.parse_args(argv)
    worker = Worker(args, start_data_parallel(**start), Path(args.out))
    worker.rank_dir.mkdir(parents=True, exist_ok=True)
    return worker


def finish_rank(out, world_rank: int) -> None:
    """Tell ``python -m mindzero.launch.local`` that this rank finished: it waits for ``out/rank_<world_rank>.done``
    from every rank (``out``: the ``--out`` it gave the script), so a rank that dies early fails the launch."""
    (Path(out) / f"rank_{world_rank}.done").write_text("ok")

"""The two tiers of the suite: the default one (CI, under 30 minutes on 2 cores) and the full one (``bash
scripts/test.sh --full``, ``pytest --full`` or ``MINDZERO_FULL_SUITE=1``), and the one rule of what a session
collects (:func:`deselect`, called by ``tests/conftest.py``): a test marked ``full`` only in the full tier; a test
that compares launch scenarios (marked ``scenarios``) only where its launch runs every scenario it names. The
parity and hybrid launches run more scenarios in the full tier (the rows whose ``Scenario.tier`` is ``"full"``)."""
import inspect
import os
from dataclasses import dataclass
from typing import Callable

FULL_ENV = "MINDZERO_FULL_SUITE"


def full_tier(config) -> bool:
    """Whether this pytest session (its ``config``) runs the full tier."""
    return bool(config.getoption("--full")) or os.environ.get(FULL_ENV) == "1"


WORKER_FLAG = "--full-tier"  # how a launch fixture tells its worker to run the full tier's matrix


def worker_args(config) -> list:
    """The worker's arguments that carry this session's tier (:data:`WORKER_FLAG` in the full tier)."""
    return [WORKER_FLAG] if full_tier(config) else []


def add_worker_flag(parser) -> None:
    """The worker side: ``args.full_tier`` is True when the launch passed :data:`WORKER_FLAG`."""
    parser.add_argument(WORKER_FLAG, action="store_true", help="the full tier's matrix (the rows of tier \"full\" too)")


@dataclass(frozen=True)
class Launch:
    """A test module's launch, for the collection rule: the fixture that holds it, and ``matrix(n, full_tier)``:
    the scenarios it runs on ``n`` ranks in a tier (``n`` is the fixture's parameter, or ``ranks``)."""

    fixture: str
    matrix: Callable
    ranks: int = None


def needed_scenarios(item, n: int) -> list:
    """The scenario names a test item compares: its ``scenarios`` marker's function of the item's parameters and
    ``n``, the launch's rank count."""
    fn = item.get_closest_marker("scenarios").args[0]
    params = {**(item.callspec.params if hasattr(item, "callspec") else {}), "n": n}
    wanted = inspect.signature(fn).parameters
    return list(fn(**{k: v for k, v in params.items() if k in wanted}))


def deselect(items, full: bool) -> tuple:
    """``(kept, dropped)``: the items this tier runs. A ``full``-marked item runs in the full tier only; an item
    marked ``ranks(n, ...)`` where its module's :class:`Launch` runs on one of those rank counts; an item marked
    ``scenarios`` where that launch runs every scenario it names (a name no launch anywhere runs is an error: a
    misspelt name must not pass unseen)."""
    kept, dropped, cache = [], [], {}
    for item in items:
        if not full and item.get_closest_marker("full") is not None:
            dropped.append(item)
            continue
        ranks, wants = item.get_closest_marker("ranks"), item.get_closest_marker("scenarios")
        if ranks is None and wants is None:
            kept.append(item)
            continue
        launch = item.module.LAUNCH
        n = item.callspec.params.get(launch.fixture, launch.ranks) if hasattr(item, "callspec") else launch.ranks
        if ranks is not None and n not in ranks.args:
            dropped.append(item)
            continue
        if wants is None:
            kept.append(item)
            continue
        key = (item.module.__name__, n, full)
        if key not in cache:
            cache[key] = {s.name for s in launch.matrix(n, full)}
            cache[key + ("any",)] = {s.name for m in (2, 4) for s in launch.matrix(m, True)}
        names = needed_scenarios(item, n)
        unknown = [x for x in names if x not in cache[key + ("any",)]]
        if unknown:
            raise ValueError(f"{item.nodeid}: scenario {unknown[0]!r} is in no launch's matrix (a misspelt name?)")
        (kept if all(x in cache[key] for x in names) else dropped).append(item)
    return kept, dropped

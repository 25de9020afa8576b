"""The one rule of what a tier collects (tests/support/tier.py), on stand-in items: no MindSpore, no launch."""
from types import SimpleNamespace

import pytest

from tests.support.scenarios import Scenario, in_tier
from tests.support.tier import Launch, deselect


class Item:
    """What ``deselect`` reads of a pytest item: its markers, parameters and module."""

    def __init__(self, module, params, **markers):
        self.module, self.callspec, self.nodeid = module, SimpleNamespace(params=params), f"t{params}"
        self.markers = {k: SimpleNamespace(args=v) for k, v in markers.items()}

    def get_closest_marker(self, name):
        return self.markers.get(name)


MATRIX = {(2, False): ["a-0", "a-1"], (2, True): ["a-0", "a-1", "a-2"], (4, False): ["a-0"], (4, True): ["a-0"]}
MODULE = SimpleNamespace(__name__="m", LAUNCH=Launch("run", lambda n, full: [SimpleNamespace(name=x)
                                                                           for x in MATRIX[n, full]]))


def items(**markers):
    return [Item(MODULE, {"run": n, "stage": s}, **markers) for n in (2, 4) for s in (0, 1, 2)]


@pytest.mark.parametrize("full, kept", [(False, [(2, 0), (2, 1), (4, 0)]), (True, [(2, 0), (2, 1), (2, 2), (4, 0)])])
def test_an_item_runs_where_its_launch_runs_every_scenario_it_names(full, kept):
    got, dropped = deselect(items(scenarios=(lambda stage: [f"a-{stage}", "a-0"],)), full)
    assert [(i.callspec.params["run"], i.callspec.params["stage"]) for i in got] == kept
    assert len(got) + len(dropped) == 6


def test_full_marker_and_rank_counts():
    kept, dropped = deselect(items(full=()), False)
    assert kept == [] and len(dropped) == 6
    kept, _ = deselect(items(ranks=(2,)), True)
    assert {i.callspec.params["run"] for i in kept} == {2}


def test_a_misspelt_scenario_fails_collection():
    with pytest.raises(ValueError, match="scenario 'a-7' is in no launch's matrix"):
        deselect(items(scenarios=(lambda: ["a-7"],)), True)


def test_scenario_tiers():
    rows = [Scenario("x", "mixed", "adamw_groups", 0), Scenario("y", "mixed", "adamw_groups", 1, tier="full")]
    assert [s.name for s in in_tier(rows, False)] == ["x"] and len(in_tier(rows, True)) == 2
    with pytest.raises(ValueError, match="tier must be one of"):
        Scenario("z", "mixed", "adamw_groups", 0, tier="nightly")

import pytest

from tests.support.tier import FULL_REASON, full_tier


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="also run the tests marked 'full' (docs/testing.md)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: run only in the full tier (--full or MINDZERO_FULL_SUITE=1)")


def pytest_collection_modifyitems(config, items):
    if full_tier(config):
        return
    skip = pytest.mark.skip(reason=FULL_REASON)
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)

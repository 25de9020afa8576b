from tests.support.tier import deselect, full_tier


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="also run the full tier (docs/testing.md)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: run only in the full tier (--full or MINDZERO_FULL_SUITE=1)")
    config.addinivalue_line("markers", "scenarios(fn): the launch scenarios a test compares (fn of its parameters "
                                       "and n, the ranks); collected only where its launch runs them all")
    config.addinivalue_line("markers", "ranks(*n): collected only where its module's launch runs on one of these "
                                       "rank counts")


def pytest_collection_modifyitems(config, items):
    """The one rule of what this tier collects (:func:`tests.support.tier.deselect`): the rest is deselected, so
    nothing skips for a tier or a rank count."""
    kept, dropped = deselect(items, full_tier(config))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

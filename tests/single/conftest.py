"""The one-process tests compile graphs in the pytest process itself, many per module."""
import pytest

from tests.support.worker import settle


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test and its fixtures: :func:`tests.support.worker.settle` (MindSpore's collection before every
    compile otherwise walks everything the earlier tests left alive)."""
    settle()

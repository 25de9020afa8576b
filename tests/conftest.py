from xdist.scheduler import LoadFileScheduling

from tests.support.tier import deselect, full_tier

# The modules that take longest, longest first (alone, 2026-11-28: the 2-rank parity launch about 8 minutes, the
# hybrid launch about 5, the one-process modules at the end of the list 2-6). scripts/test.sh runs every module on
# two pytest-xdist workers, one module per worker at a time, in this order (:class:`InOrder`): starting the longest
# first keeps the two workers' last modules short, so they finish together. Modules not listed follow, in their
# own order.
LONGEST_FIRST = ("multirank/test_parity.py", "multirank/test_hybrid.py", "multirank/test_checkpoint.py",
                 "multirank/test_optimizers.py", "multirank/test_sharded_init.py", "single/test_one_process.py",
                 "single/test_fit.py", "multirank/test_example.py", "multirank/test_quant.py",
                 "multirank/test_fit.py", "multirank/test_offload.py", "single/test_optimizers.py",
                 "multirank/test_faults.py", "multirank/test_model_train.py", "multirank/test_launch.py",
                 "multirank/test_launcher.py", "single/test_offload.py")


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
    items[:] = sorted(items, key=_module_rank)  # stable: each module's own order is kept


def _module_rank(item) -> int:
    """Where ``item``'s module comes in :data:`LONGEST_FIRST` (after every listed one if it is not there)."""
    path = item.path.as_posix()
    return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name)), len(LONGEST_FIRST))


class InOrder(LoadFileScheduling):
    """pytest-xdist's ``loadfile`` (one module per worker at a time), handing out the modules in collection order
    (:data:`LONGEST_FIRST`) instead of xdist's order, by number of tests (a multi-rank module is a few tests behind
    one long launch, and would otherwise start last), and to a worker only when it is down to its last test (the
    one a worker holds back until it knows the next): xdist's own threshold, two tests, queues every module of two
    or three tests behind whichever worker asks first, which left one worker idle while the other still had modules
    queued."""

    def _reschedule(self, node):
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) <= 1:
            self._assign_work_unit(node)

    def _assign_work_unit(self, node):
        if not getattr(self, "_ordered", False):
            first = {}
            for i, nodeid in enumerate(self.collection):
                first.setdefault(self._split_scope(nodeid), i)
            for scope in sorted(self.workqueue, key=first.__getitem__):
                self.workqueue.move_to_end(scope)
            self._ordered = True
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` in collection order (:class:`InOrder`)."""
    return InOrder(config, log) if config.getoption("dist") == "loadfile" else None

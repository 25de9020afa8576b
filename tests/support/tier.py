"""The two tiers of the suite: the default one (CI, under 30 minutes on 2 cores) and the full one (``bash
scripts/test.sh --full``, ``pytest --full`` or ``MINDZERO_FULL_SUITE=1``). Tests marked ``full`` run only in the
full tier (``tests/conftest.py``); the parity and hybrid launches also run more scenarios there
(``tests.support.scenarios.FULL_TIER_ONLY``)."""
import os

FULL_ENV = "MINDZERO_FULL_SUITE"
FULL_REASON = ("full tier only (the default suite stays under 30 minutes on 2 cores): run "
               "`bash scripts/test.sh --full` or set MINDZERO_FULL_SUITE=1 (docs/testing.md)")


def full_tier(config) -> bool:
    """Whether this pytest session (its ``config``) runs the full tier."""
    return bool(config.getoption("--full")) or os.environ.get(FULL_ENV) == "1"

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


WORKER_FLAG = "--full-tier"  # how a launch fixture tells its worker to run the full tier's matrix


def worker_args(config) -> list:
    """The worker's arguments that carry this session's tier (:data:`WORKER_FLAG` in the full tier)."""
    return [WORKER_FLAG] if full_tier(config) else []


def add_worker_flag(parser) -> None:
    """The worker side: ``args.full_tier`` is True when the launch passed :data:`WORKER_FLAG`."""
    parser.add_argument(WORKER_FLAG, action="store_true", help="the full tier's matrix (scenarios.FULL_TIER_ONLY too)")

"""The value checks every validator shares (pure Python): one definition of "an int" and "a number"."""
from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer, and not a bool (``True`` is an ``int`` to Python, never a count to mindzero)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number that is not a bool and not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def require_int(name: str, value, minimum: int) -> int:
    """``value`` as an int, or ``ValueError("<name> must be an int >= <minimum>, got <value>")``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def require_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value

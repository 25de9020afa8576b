"""Deprecated names that keep working, and the warning they give (pure Python).

A name that changed keeps a working alias that warns once per call site with
:class:`MindzeroDeprecationWarning` (a ``FutureWarning``, so users see it) and
names the replacement. mindzero's own code and tests use only the new names:
the test suite turns this warning into an error.
"""
from __future__ import annotations

import warnings


class MindzeroDeprecationWarning(FutureWarning):
    """A mindzero name that still works but has a new one; the message names it."""


def warn_renamed(old: str, new: str, why: str = "", stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated, use {new}" + (f" ({why})" if why else ""), MindzeroDeprecationWarning,
                  stacklevel=stacklevel)


def renamed_property(old: str, new: str, why: str = "") -> property:
    """A read-only property ``old`` that warns and returns attribute ``new``."""

    def get(self):
        warn_renamed(f"{type(self).__name__}.{old}", f"{type(self).__name__}.{new}", why)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: use ``{new}``.")

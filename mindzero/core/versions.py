"""The MindSpore versions mindzero installs beside, and the versions of what a run depends on (pure Python: read
from the installed packages' metadata, nothing imported).

mindzero never replaces the user's MindSpore (on Ascend, the one matched to their CANN): the package declares
only the oldest MindSpore it was tested on (:data:`MINDSPORE_REQUIREMENT`), so ``pip install mindzero`` leaves any
later one in place. The versions the test suite ran on are :data:`TESTED_MINDSPORE` (docs/backends.md has the
matrix and the command that reproduces it). A MindSpore newer than the newest tested gets a warning naming both,
once per process (:func:`check_mindspore`); an older one (installed with ``--no-deps``) is refused, as is any
version that lacks a feature mindzero needs for what the user asked (:func:`require_feature`).
"""
from __future__ import annotations

import re
import warnings

#: the oldest MindSpore the suite ran on; the package's one requirement on MindSpore
MINDSPORE_FLOOR = "2.7.1"
MINDSPORE_REQUIREMENT = f"mindspore>={MINDSPORE_FLOOR}"
#: every MindSpore release the test suite's core ran on (``bash scripts/test.sh --mindspore VERSION``)
TESTED_MINDSPORE = ("2.7.1", "2.7.2", "2.8.0", "2.9.0", "2.10.0")
#: what ``scripts/setup_env.sh`` installs into ``.venv`` without ``--mindspore``, and CI runs on
DEFAULT_MINDSPORE = "2.10.0"


def release(version: str) -> tuple:
    """The numeric release of a version string: ``"2.10.0"`` -> ``(2, 10, 0)``, ``"2.7.1.post1"`` -> ``(2, 7, 1)``,
    ``"2.11.0rc1"`` -> ``(2, 11, 0)``.

    Raises:
        ValueError: a string that does not start with a dotted number.
    """
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not match:
        raise ValueError(f"version {version!r}: not a version number (expected e.g. '2.10.0')")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def support(version: str) -> str:
    """How mindzero stands to a MindSpore ``version``: ``"tested"`` (its release is one the suite ran on, post
    releases included), ``"newer"`` (past the newest tested: installs, runs, untested), ``"between"`` (inside the
    tested range but not itself run, such as a patch release) or ``"older"`` (below :data:`MINDSPORE_FLOOR`)."""
    r = release(version)
    tested = sorted(release(v) for v in TESTED_MINDSPORE)
    if r in tested:
        return "tested"
    if r < release(MINDSPORE_FLOOR):
        return "older"
    return "newer" if r > tested[-1] else "between"


class UnsupportedMindSpore(RuntimeError):
    """The installed MindSpore is older than mindzero supports, or lacks a feature the run asked for."""


_WARNED = set()


def check_mindspore(version: str) -> str:
    """Refuse a MindSpore older than :data:`MINDSPORE_FLOOR`, warn once per process about one newer than every
    tested version, and return :func:`support`'s answer.

    Raises:
        UnsupportedMindSpore: naming the version and the floor.
    """
    status = support(version)
    if status == "older":
        raise UnsupportedMindSpore(
            f"MindSpore {version} is older than mindzero supports ({MINDSPORE_REQUIREMENT}; tested on "
            f"{', '.join(TESTED_MINDSPORE)}); install a supported MindSpore for your device")
    if status == "newer" and version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(f"mindzero was tested on MindSpore {', '.join(TESTED_MINDSPORE)}, not on {version}: it should "
                      "work, and `bash scripts/test.sh --mindspore VERSION` runs the suite's core on it "
                      "(docs/backends.md)", stacklevel=2)
    return status


def require_feature(available: bool, feature: str, version: str, needed_for: str) -> None:
    """Refuse what the user asked when this MindSpore lacks a feature it needs.

    Raises:
        UnsupportedMindSpore: naming the MindSpore version, the feature and what needed it.
    """
    if not available:
        raise UnsupportedMindSpore(f"{needed_for} needs {feature}, which MindSpore {version} does not have; "
                                   f"mindzero is tested on MindSpore {', '.join(TESTED_MINDSPORE)}")


#: settings a tested MindSpore trains less exactly than mindzero's parity bar: ``{(version, setting): what differs}``
KNOWN_DEVIATIONS = {
    ("2.7.1", "param_dtype"): "stages 1-3 with param_dtype differ from stage 0 by up to about 1e-2 relative "
                              "(elsewhere: within 1e-3); MindSpore 2.7.2 and later train them as stage 0",
}


def warn_deviation(version: str, setting: str) -> bool:
    """Warn once per process when ``setting`` is in :data:`KNOWN_DEVIATIONS` for MindSpore ``version``; whether it
    is."""
    what = KNOWN_DEVIATIONS.get((version, setting))
    if what is None:
        return False
    if (version, setting) not in _WARNED:
        _WARNED.add((version, setting))
        warnings.warn(f"MindSpore {version}: {what} (docs/backends.md#mindspore-versions)", stacklevel=3)
    return True


#: the distributions a bug report names, with the name each is installed under
REPORTED = (("mindzero", "mindzero"), ("mindspore", "mindspore"), ("numpy", "numpy"), ("mindone", "mindone"),
            ("mindcv", "mindcv"), ("pyyaml", "PyYAML"))


def installed_versions() -> dict:
    """``{name: version or None}`` of :data:`REPORTED`, from the installed packages' metadata (nothing imported)."""
    from importlib import metadata

    out = {}
    for name, dist in REPORTED:
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out

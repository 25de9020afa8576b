"""The user's machine, pure: the MindSpore range the package declares against the versions docs/backends.md lists as
tested, how a MindSpore version is judged, the device override rules and the collectives each backend runs."""
import re
import runpy
import sys
import types
import warnings
from pathlib import Path

import pytest

from mindzero.core import versions
from mindzero.core.topology import (BACKENDS, COLLECTIVES, EMULATED, EMULATED_ROUTE, LOCAL, OPERATIONS, REAL,
                                    SUBSTITUTE, SUBSTITUTED, collective_routes, requested_device)
from mindzero.core.versions import (MINDSPORE_FLOOR, MINDSPORE_REQUIREMENT, TESTED_MINDSPORE, UnsupportedMindSpore,
                                    check_mindspore, release, require_feature, support)

ROOT = Path(__file__).resolve().parents[2]


def setup_arguments(monkeypatch) -> dict:
    """What setup.py hands setuptools (run with ``setup`` captured: nothing is built)."""
    captured = {}
    fake = types.ModuleType("setuptools")
    fake.setup = lambda **kw: captured.update(kw)
    fake.find_packages = lambda **kw: ["mindzero"]
    monkeypatch.setitem(sys.modules, "setuptools", fake)
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return captured


def test_the_package_declares_the_tested_floor_and_no_pin(monkeypatch):
    """One requirement on MindSpore, a lower bound only (pip leaves any later MindSpore in place), the oldest version
    tested; numpy<2, which MindSpore 2.7-2.10 need; test-only and example-only packages in extras."""
    args = setup_arguments(monkeypatch)
    requires = args["install_requires"]
    on_mindspore = [r for r in requires if re.match(r"mindspore\b", r)]
    assert on_mindspore == [MINDSPORE_REQUIREMENT] == [f"mindspore>={MINDSPORE_FLOOR}"]
    assert not any("==" in r or "<" in r for r in on_mindspore)
    assert "numpy<2" in requires
    assert not any(r.startswith(("pytest", "matplotlib", "mindcv", "mindone")) for r in requires), requires
    assert {"test", "examples"} <= set(args["extras_require"])
    assert any(r.startswith("pytest") for r in args["extras_require"]["test"])
    assert ("mindzero-env=mindzero.env:main" in args["entry_points"]["console_scripts"])
    assert release(MINDSPORE_FLOOR) == min(release(v) for v in TESTED_MINDSPORE)
    assert all(support(v) == "tested" for v in TESTED_MINDSPORE)


def backends_matrix() -> list:
    """The MindSpore versions of docs/backends.md's matrix: the first column of the table under its heading."""
    text = (ROOT / "docs" / "backends.md").read_text()
    section = text.split("## MindSpore versions", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")]
    return [re.sub(r"[^0-9.]", "", r) for r in rows if re.match(r"\s*\**\d", r)]


def test_docs_list_exactly_the_versions_tested():
    """docs/backends.md's matrix has one row per tested version (what the suite's core ran on), and the default
    version the scripts install is one of them."""
    assert sorted(backends_matrix(), key=release) == sorted(TESTED_MINDSPORE, key=release)
    assert versions.DEFAULT_MINDSPORE in TESTED_MINDSPORE


@pytest.mark.parametrize("text, parsed", [("2.10.0", (2, 10, 0)), ("2.7.1.post1", (2, 7, 1)), ("2.11.0rc1", (2, 11, 0)),
                                          ("2.8", (2, 8, 0)), ("v2.9.0", (2, 9, 0))])
def test_release_numbers(text, parsed):
    assert release(text) == parsed


def test_a_version_that_is_no_number_is_refused():
    with pytest.raises(ValueError, match=r"version 'dev': not a version number \(expected e.g. '2.10.0'\)"):
        release("dev")


@pytest.mark.parametrize("version, status", [("2.7.1", "tested"), ("2.7.1.post1", "tested"), ("2.10.0", "tested"),
                                             ("2.8.1", "between"), ("2.10.1", "newer"), ("2.11.0", "newer"),
                                             ("2.7.0", "older"), ("2.6.0", "older")])
def test_support(version, status):
    assert support(version) == status


def test_an_older_mindspore_is_refused_naming_the_version_and_the_floor():
    with pytest.raises(UnsupportedMindSpore, match=r"MindSpore 2\.6\.0 is older than mindzero supports "
                                                   r"\(mindspore>=2\.7\.1; tested on 2\.7\.1, .*2\.10\.0\)"):
        check_mindspore("2.6.0")


def test_a_newer_mindspore_warns_once(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"tested on MindSpore 2\.7\.1, .*, not on 2\.12\.0"):
        assert check_mindspore("2.12.0") == "newer"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_mindspore("2.12.0") == "newer"  # once per process
        assert check_mindspore("2.10.0") == "tested"  # a tested version: silent


def test_a_missing_feature_is_refused_naming_version_feature_and_use():
    require_feature(True, "x", "2.10.0", "y")
    with pytest.raises(UnsupportedMindSpore, match=r"mindzero.lazy_init\(\) needs Parameter.init_param, which "
                                                   r"MindSpore 2\.99\.0 does not have"):
        require_feature(False, "Parameter.init_param", "2.99.0", "mindzero.lazy_init()")


@pytest.mark.parametrize("device, environ, chosen", [
    (None, {}, None),                                   # nothing asked: MindSpore's own device stands
    (None, {"MINDZERO_DEVICE": ""}, None),              # set but empty: the same
    (None, {"MINDZERO_DEVICE": "ascend"}, "Ascend"),    # the variable, any case
    ("gpu", {}, "GPU"),
    ("CPU", {"MINDZERO_DEVICE": "Ascend"}, "CPU"),      # the argument wins over the variable
])
def test_the_device_is_chosen_only_where_asked(device, environ, chosen):
    assert requested_device(device, environ) == chosen


@pytest.mark.parametrize("device, environ, message", [
    ("TPU", {}, r"device='TPU': must be one of CPU, GPU, Ascend \(any case\), or unset to keep MindSpore's own device"),
    (3, {}, r"device=3: must be one of CPU, GPU, Ascend"),
    (None, {"MINDZERO_DEVICE": "npu"}, r"MINDZERO_DEVICE='npu': must be one of CPU, GPU, Ascend"),
])
def test_a_device_that_names_none_is_refused(device, environ, message):
    with pytest.raises(ValueError, match=message):
        requested_device(device, environ)


def test_every_backend_states_every_operation():
    for backend in BACKENDS:
        for hybrid in (False, True):
            assert tuple(r.operation for r in collective_routes(backend, hybrid)) == OPERATIONS


def test_what_is_real_and_what_is_emulated():
    """GPU/Ascend run MindSpore's own primitive for every operation; CPU emulates the reduce-scatter (and everything
    on a sub-group); the test-only substitute replaces the group primitives only; one rank communicates nothing."""
    kinds = lambda backend, hybrid=False: {r.operation: r.kind for r in collective_routes(backend, hybrid)}  # noqa
    assert set(kinds(COLLECTIVES).values()) == set(kinds(COLLECTIVES, True).values()) == {REAL}
    cpu = kinds(EMULATED)
    assert cpu["reduce-scatter"] == cpu["stage-3 gather"] == cpu["int8 gather"] == EMULATED_ROUTE
    assert cpu["all-gather"] == cpu["all-reduce"] == cpu["broadcast"] == REAL
    assert kinds(EMULATED, True)["all-gather"] == kinds(EMULATED, True)["broadcast"] == EMULATED_ROUTE
    assert kinds(SUBSTITUTE)["reduce-scatter"] == SUBSTITUTED and kinds(SUBSTITUTE)["all-reduce"] == REAL
    assert set(kinds("single").values()) == {LOCAL}
    with pytest.raises(ValueError, match="backend must be one of"):
        collective_routes("nccl")


def test_a_known_deviation_is_warned_once_and_only_on_its_version(monkeypatch):
    """param_dtype at stages 1-3 on MindSpore 2.7.1 (docs/backends.md's matrix) warns, naming the version and the
    versions without it; other versions and settings do not."""
    monkeypatch.setattr(versions, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"MindSpore 2\.7\.1: stages 1-3 with param_dtype .* 2\.7\.2 and later"):
        assert versions.warn_deviation("2.7.1", "param_dtype")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert versions.warn_deviation("2.7.1", "param_dtype")  # once per process
        assert not versions.warn_deviation("2.7.2", "param_dtype")
        assert not versions.warn_deviation("2.10.0", "param_dtype")
        assert not versions.warn_deviation("2.7.1", "offload")
    assert all(v in TESTED_MINDSPORE for v, _ in versions.KNOWN_DEVIATIONS)

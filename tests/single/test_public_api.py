"""What users call keeps working: every name of ``mindzero``'s public table, every console script, the two
``python -m`` launchers, every module path the README and docs name."""
import importlib
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import mindzero

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
def resolve(path: str):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def named_in_docs() -> list:
    """Every ``mindzero.x.y`` path and ``from mindzero.x import a, b`` name in the README and docs."""
    found = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, names in re.findall(r"from (mindzero(?:\.\w+)*) import ([\w, ]+)", text):
            found.update(f"{module}.{n.strip()}" for n in names.split(",") if n.strip())
        found.update(re.findall(r"\bmindzero(?:\.\w+)+", text))
    return sorted(p for p in found if not p.endswith((".py", ".md", ".yaml")))


def test_every_public_name_resolves():
    assert len(mindzero.__all__) > 40
    for name in mindzero.__all__:
        assert getattr(mindzero, name) is not None, name


def test_every_console_script_resolves():
    scripts = [e for e in entry_points(group="console_scripts") if e.value.startswith("mindzero.")]
    assert sorted(e.name for e in scripts) == ["mindzero-env", "mindzero-estimate", "mindzero-merge", "mindzero-plan",
                                               "mindzero-reshard", "mindzero-verify"]
    for e in scripts:
        assert callable(e.load()), e


@pytest.mark.parametrize("module", ["mindzero.launch", "mindzero.launch.local"])
def test_python_dash_m_launchers(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "usage:" in out.stdout and "script" in out.stdout, out.stderr[-1000:]


def test_every_path_the_docs_name_resolves():
    paths = named_in_docs()
    assert len(paths) > 20, paths
    for path in paths:
        resolve(path)


def test_prepare_train_network_signature_is_the_options_table():
    """``prepare_train_network``'s signature (mindone's order) repeats the one options table: names, order and
    defaults."""
    import inspect

    from mindzero.core.options import OPTIONS

    params = inspect.signature(mindzero.prepare_train_network).parameters
    assert list(params)[:2] == ["network", "optimizer"] and list(params)[-1] == "config"
    assert [(k, p.default) for k, p in list(params.items())[2:-1]] == [(o.name, o.default) for o in OPTIONS if o.argument]
    assert list(params)[:16] == ["network", "optimizer", "scale_sense", "ema", "updates", "drop_overflow_update",
                                 "gradient_accumulation_steps", "clip_grad", "clip_norm", "verbose", "zero_stage",
                                 "optimizer_offload", "optimizer_parallel_group", "dp_group", "comm_fusion",
                                 "parallel_modules"]  # mindone's order: positional calls keep working


def test_config_takes_a_zero_config():
    from mindspore import nn

    from mindzero.core.config import ZeroConfig
    from tests.support.models import build, make_optimizer

    zero = ZeroConfig.from_arguments({"zero_stage": 2, "clip_grad": True})
    net = build("mlp")
    train = mindzero.prepare_train_network(net, make_optimizer("adamw", net), config=zero)
    assert train.zero_info.config is zero
    net = build("mlp")
    with pytest.raises(ValueError, match="clip_norm=2.0 is given as an argument while config is a ZeroConfig"):
        mindzero.prepare_train_network(net, make_optimizer("adamw", net), clip_norm=2.0, config=zero)
    with pytest.raises(TypeError, match="config must be None, a settings file path, a settings mapping or a ZeroConfig, got int"):
        mindzero.prepare_train_network(net, nn.Momentum(net.trainable_params(), 0.1, 0.9), config=3)

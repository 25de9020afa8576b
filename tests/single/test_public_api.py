"""What users call keeps working: every name of ``mindzero``'s public table, every console script, the two
``python -m`` launchers, every module path the README and docs name, and the module paths of mindzero before
its package layout (they resolve to the moved modules and warn with the new path)."""
import importlib
import re
import subprocess
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import mindzero
from mindzero import MindzeroDeprecationWarning

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# module paths (and names in them) the README and docs named before the package layout of issue 22
OLD_PATHS = ["mindzero.merge.merge_checkpoint", "mindzero.merge.main_merge", "mindzero.merge.main_reshard",
             "mindzero.merge.verify_checkpoint", "mindzero.estimate.paper_formula", "mindzero.estimate.main",
             "mindzero.plan.ParamInfo", "mindzero.plan.PartitionPlan", "mindzero.layout.HybridLayout",
             "mindzero.config.ZeroConfig", "mindzero.comm_plan.summarize", "mindzero.comm_plan.plan_state",
             "mindzero.comm_plan.step_calls", "mindzero.prepare.plan_text", "mindzero.split_info.SplitInfo",
             "mindzero.split_info.TensorEntry", "mindzero.split_info.split_info_name", "mindzero.split_info.write_marker",
             "mindzero.ckpt_io.crc32_array", "mindzero.local_launch.msrun", "mindzero.local_launch.launch",
             "mindzero.local_launch.MemoryWatch", "mindzero.local_launch.MemoryLimitExceeded",
             "mindzero.comm.substitute_collectives", "mindzero.comm.ShardGather", "mindzero.comm.AllGather",
             "mindzero.checkpoint.complete_checkpoints", "mindzero.checkpoint.latest_checkpoint", "mindzero.runtime",
             "mindzero.settings.load_config", "mindzero.memory.expected_bytes", "mindzero.materialize.lazy_init",
             "mindzero.callback.ZeroCheckpoint", "mindzero.launch.cluster_env"]


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
    assert sorted(e.name for e in scripts) == ["mindzero-estimate", "mindzero-merge", "mindzero-reshard",
                                               "mindzero-verify"]
    for e in scripts:
        assert callable(e.load()), e


@pytest.mark.parametrize("module", ["mindzero.launch", "mindzero.local_launch"])
def test_python_dash_m_launchers(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "usage:" in out.stdout and "script" in out.stdout, out.stderr[-1000:]


def test_every_path_the_docs_name_resolves():
    paths = named_in_docs()
    assert len(paths) > 20, paths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MindzeroDeprecationWarning)
        for path in paths:
            resolve(path)


@pytest.mark.parametrize("path", OLD_PATHS)
def test_old_module_paths_still_resolve(path):
    old_module = path.rsplit(".", 1)[0] if path.count(".") > 1 else path
    moved = old_module in mindzero.MOVED_MODULES and old_module not in sys.modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve(path) is not None
    if moved:  # the first import of an old path warns, naming the new one
        assert any(issubclass(w.category, MindzeroDeprecationWarning) and mindzero.MOVED_MODULES[old_module] in
                   str(w.message) for w in caught), [str(w.message) for w in caught]


def test_an_old_path_is_the_moved_module_itself():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MindzeroDeprecationWarning)
        import mindzero.plan as old
    import mindzero.core.plan as new
    assert old is new


def test_deprecated_names_warn_and_keep_their_meaning():
    from mindzero.core.plan import ParamInfo, PartitionPlan

    with pytest.warns(MindzeroDeprecationWarning, match="PartitionPlan.build\\(rank=\\) is deprecated, use "
                                                       "PartitionPlan.build\\(op_rank=\\)"):
        plan = PartitionPlan.build([ParamInfo("w", (7, 15))], 4, rank=1)
    with pytest.warns(MindzeroDeprecationWarning, match="ShardSpec.rank is deprecated, use ShardSpec.op_rank"):
        assert plan["w"].rank == plan["w"].op_rank == 1
    world = mindzero.World.flat("CPU", 4, 3)
    with pytest.warns(MindzeroDeprecationWarning, match="World.group_size is deprecated, use World.op_size"):
        assert world.group_size == world.op_size == 4


def test_prepare_train_network_defaults_are_the_options_defaults():
    """``prepare_train_network``'s signature (mindone's) repeats the defaults of the one options table."""
    import inspect

    from mindzero.core.config import ARGUMENT_DEFAULTS

    params = inspect.signature(mindzero.prepare_train_network).parameters
    defaults = {k: p.default for k, p in params.items() if k not in ("network", "optimizer", "config")}
    assert defaults == {k: v for k, v in ARGUMENT_DEFAULTS.items() if k != "hybrid_shard_size"}
    assert list(params)[:16] == ["network", "optimizer", "scale_sense", "ema", "updates", "drop_overflow_update",
                                 "gradient_accumulation_steps", "clip_grad", "clip_norm", "verbose", "zero_stage",
                                 "optimizer_offload", "optimizer_parallel_group", "dp_group", "comm_fusion",
                                 "parallel_modules"]  # mindone's order: positional calls keep working

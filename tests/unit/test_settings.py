"""The settings file (``mindzero.load_config``), without MindSpore: round trip, defaults, and every rule's
error naming the file, the key, the value and the rule."""
import subprocess
import sys

import pytest
import yaml

from mindzero import ConfigError, load_config
from mindzero.core.settings import CHECKPOINT_DEFAULTS, check_settings, resolve_settings

FULL = {
    "zero_stage": 3, "gradient_accumulation_steps": 2, "clip_grad": True, "clip_norm": 0.5,
    "drop_overflow_update": False, "verbose": False,
    "scale_sense": {"init_loss_scale": 65536.0, "scale_factor": 2.0, "scale_window": 1000},
    "ema": 0.999, "updates": 3, "optimizer_offload": False, "stage3_regather": False,
    "comm_fusion": {"allreduce": {"openstate": True, "bucket_size": 1024}},
    "param_dtype": "float16", "reduce_dtype": "float32", "hybrid_shard_size": 2,
    "checkpoint": {"dir": "ckpts", "save_every": 4, "keep": 3, "format": "safetensors", "async_save": True},
}


def write(tmp_path, data, name="zero.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_no_mindspore_import():
    code = ("import sys, mindzero, mindzero.core.settings; mindzero.load_config; "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


def test_round_trip_every_key(tmp_path):
    assert load_config(write(tmp_path, FULL)) == FULL
    assert resolve_settings(str(write(tmp_path, FULL))) == FULL
    assert resolve_settings(FULL) == FULL and check_settings(check_settings(FULL)) == FULL  # idempotent


def test_defaults_and_empty_file(tmp_path):
    assert load_config(write(tmp_path, "")) == {"checkpoint": CHECKPOINT_DEFAULTS}
    got = load_config(write(tmp_path, {"zero_stage": 1, "checkpoint": {"dir": "c"}}))
    assert got == {"zero_stage": 1, "checkpoint": {**CHECKPOINT_DEFAULTS, "dir": "c"}}
    assert got["checkpoint"]["keep"] == 2 and got["checkpoint"]["save_every"] is None


def test_section_of_an_application_file(tmp_path):
    path = write(tmp_path, {"model": {"dim": 64}, "zero": {"zero_stage": 2}})
    assert load_config(path, section="zero") == {"zero_stage": 2, "checkpoint": CHECKPOINT_DEFAULTS}
    with pytest.raises(ConfigError, match=r"zero.yaml: no top-level key 'mindzero'"):
        load_config(path, section="mindzero")
    with pytest.raises(ConfigError, match=r"zero.yaml \[zero\]: unknown key 'stage'"):
        load_config(write(tmp_path, {"zero": {"stage": 2}}), section="zero")


@pytest.mark.parametrize("key, value, rule", [
    ("zero_stage", "2", "zero_stage must be 0, 1, 2 or 3, got '2'"),
    ("zero_stage", 4, "zero_stage must be 0, 1, 2 or 3, got 4"),
    ("gradient_accumulation_steps", 1.5, "must be an int >= 1"),
    ("gradient_accumulation_steps", 0, "must be an int >= 1"),
    ("clip_grad", "yes", "clip_grad must be a bool, got 'yes'"),
    ("clip_norm", -1, "must be a number > 0"),
    ("drop_overflow_update", 1, "drop_overflow_update must be a bool, got 1"),
    ("scale_sense", 0, "scale_sense must be > 0, got 0.0"),
    ("scale_sense", {"init_loss_scale": 1024}, "exactly the keys init_loss_scale, scale_factor, scale_window"),
    ("scale_sense", {"init_loss_scale": 1024, "scale_factor": 1, "scale_window": 10}, "scale_factor a number > 1"),
    ("ema", 1.5, "ema must be None, a decay in \\(0, 1\\)"),
    ("updates", -2, "must be an int >= 0"),
    ("optimizer_offload", "false", "optimizer_offload must be a bool, 'host' or 'disk'"),
    ("optimizer_offload", "disk", "offload_dir must be a directory path when optimizer_offload='disk', got None"),
    ("offload_dir", "/scratch", "offload_dir='/scratch' is given but optimizer_offload=False"),
    ("offload_chunk_mb", -1, "offload_chunk_mb must be a number > 0"),
    ("stage3_regather", None, "stage3_regather must be a bool"),
    ("comm_fusion", {"broadcast": {}}, "comm_fusion key 'broadcast' is not one of"),
    ("comm_fusion", {"allgather": {"bucket_size": 0}}, "bucket_size'\\] must be a number of bytes >= 1"),
    ("param_dtype", 16, "param_dtype must be None, float16 or bfloat16"),
    ("param_dtype", "float64", "param_dtype must be None, float16 or bfloat16"),
    ("hybrid_shard_size", 0, "hybrid_shard_size must be None or an int >= 1"),
])
def test_bad_value_names_file_key_value_rule(tmp_path, key, value, rule):
    path = write(tmp_path, {key: value})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: key {key!r}: value {value!r}: "), msg
    assert err.match(rule)


def test_reduce_dtype_without_param_dtype_names_reduce_dtype(tmp_path):
    """Without param_dtype a 16-bit reduce_dtype (or float32, the default) is accepted; anything else names the
    key, the value and the rule."""
    assert load_config(write(tmp_path, {"reduce_dtype": "float16"}))["reduce_dtype"] == "float16"
    path = write(tmp_path, {"reduce_dtype": "int8"})
    with pytest.raises(ConfigError, match=rf"{path}: key 'reduce_dtype': value 'int8': reduce_dtype must be None, "
                                          "float32, float16 or bfloat16"):
        load_config(path)


@pytest.mark.parametrize("key, value, rule", [
    ("dir", "", "dir must be a non-empty path"),
    ("save_every", 0, "save_every must be None \\(save at the end only\\) or an int >= 1"),
    ("keep", -1, "keep must be an int >= 0"),
    ("format", "h5", "format must be one of \\['ckpt', 'safetensors'\\]"),
    ("async_save", "yes", "async_save must be a bool"),
])
def test_bad_checkpoint_value(tmp_path, key, value, rule):
    path = write(tmp_path, {"checkpoint": {key: value}})
    with pytest.raises(ConfigError, match=rf"^{path}: key 'checkpoint.{key}': value {value!r}: {rule}"):
        load_config(path)


def test_unknown_keys(tmp_path):
    path = write(tmp_path, {"zero_stag": 2})
    with pytest.raises(ConfigError, match=rf"{path}: unknown key 'zero_stag' \(value 2\); the keys are \[.*'zero_stage'"):
        load_config(path)
    path = write(tmp_path, {"checkpoint": {"every": 5}})
    with pytest.raises(ConfigError, match=r"unknown key 'checkpoint.every' \(value 5\); the keys of 'checkpoint' are"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"key 'checkpoint': value 5: must be a mapping"):
        load_config(write(tmp_path, {"checkpoint": 5}))


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"missing.yaml: cannot read the settings file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML"):
        load_config(write(tmp_path, "zero_stage: [1,\n", "bad.yaml"))
    with pytest.raises(ConfigError, match=r"list.yaml: must be a mapping of settings, got list"):
        load_config(write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    with pytest.raises(ConfigError, match=r"^config: must be a mapping"):
        resolve_settings(42)


def test_disk_offload_in_a_settings_file(tmp_path):
    data = {"zero_stage": 2, "optimizer_offload": "disk", "offload_dir": "/scratch/states", "offload_chunk_mb": 16,
            "offload_keep": True}
    assert {k: v for k, v in load_config(write(tmp_path, data)).items() if k != "checkpoint"} == data

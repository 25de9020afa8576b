"""mindzero's settings file: the :func:`mindzero.prepare_train_network` arguments, and the checkpoint
settings of :class:`mindzero.ZeroCheckpoint`, in YAML (or a dict). Pure: no MindSpore needed.

```yaml
zero_stage: 3
gradient_accumulation_steps: 2
clip_grad: true
clip_norm: 1.0
scale_sense: {init_loss_scale: 65536, scale_factor: 2, scale_window: 1000}   # or a number
param_dtype: float16            # mixed precision (null: off); reduce_dtype: float32 to reduce in fp32
hybrid_shard_size: 2            # shard inside groups of 2 ranks (mindzero.create_hybrid_groups)
checkpoint: {dir: checkpoints, save_every: 100, keep: 2, format: ckpt}
```

Every key is optional. The keys are the names of ``prepare_train_network``'s arguments that a file can
hold (``network``, ``optimizer`` and the group names cannot; ``hybrid_shard_size`` stands for the
groups), plus ``checkpoint``. An unknown key, a wrong type or a bad value raises :class:`ConfigError`
naming the file, the key, the value and the rule.
"""
from __future__ import annotations

import numbers
from pathlib import Path

from .config import MixedPrecision, parse_comm_fusion, stage_policy

FORMATS = ("ckpt", "safetensors")
CHECKPOINT_DEFAULTS = {"dir": None, "save_every": None, "keep": 2, "format": "ckpt", "async_save": False}


class ConfigError(ValueError):
    """A settings file or dict breaks a rule; the message names the source, the key, the value and the rule."""


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v


def _rule(ok, rule):
    def check(value):
        if not ok(value):
            raise ValueError(rule)
        return value
    return check


def _by_parser(parse):
    """A check that runs one of the library's own parsers (so the file obeys exactly prepare's rules)."""
    def check(value):
        parse(value)
        return value
    return check


def _scale_sense(value):
    if _is_number(value):
        if value > 0:
            return float(value)
        raise ValueError("must be a number > 0 (a static loss scale)")
    keys = {"init_loss_scale", "scale_factor", "scale_window"}
    if not isinstance(value, dict) or set(value) != keys:
        raise ValueError("must be a number > 0 (static) or a mapping with exactly the keys init_loss_scale, "
                         "scale_factor, scale_window (dynamic, nn.DynamicLossScaleUpdateCell)")
    init, factor, window = value["init_loss_scale"], value["scale_factor"], value["scale_window"]
    if not (_is_number(init) and init > 0 and _is_number(factor) and factor > 1 and _is_int(window) and window >= 1):
        raise ValueError("init_loss_scale must be a number > 0, scale_factor a number > 1, scale_window an int >= 1")
    return {"init_loss_scale": float(init), "scale_factor": float(factor), "scale_window": int(window)}


def _dtype_name(value):
    if value is not None and not isinstance(value, str):
        raise ValueError("must be null or a dtype name (float16, bfloat16, float32)")
    return value


def _bool(value):
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


#: key -> check (returns the normalised value or raises ValueError with the rule)
PREPARE_KEYS = {
    "zero_stage": _by_parser(lambda v: stage_policy(v)),
    "gradient_accumulation_steps": _rule(lambda v: _is_int(v) and v >= 1, "must be an int >= 1"),
    "clip_grad": _bool,
    "clip_norm": _rule(lambda v: _is_number(v) and v > 0, "must be a number > 0"),
    "drop_overflow_update": _bool,
    "verbose": _bool,
    "scale_sense": _scale_sense,
    "ema": _rule(lambda v: v is None or (_is_number(v) and 0 < v < 1), "must be null or a decay in (0, 1)"),
    "updates": _rule(lambda v: _is_int(v) and v >= 0, "must be an int >= 0"),
    "optimizer_offload": _bool,
    "stage3_regather": _bool,
    "comm_fusion": _by_parser(parse_comm_fusion),
    "param_dtype": _dtype_name,
    "reduce_dtype": _dtype_name,
    "hybrid_shard_size": _rule(lambda v: v is None or (_is_int(v) and v >= 1),
                               "must be null or an int >= 1 (ranks per sharding group)"),
}

CHECKPOINT_KEYS = {
    "dir": _rule(lambda v: v is None or (isinstance(v, str) and v != ""), "must be a non-empty path"),
    "save_every": _rule(lambda v: v is None or (_is_int(v) and v >= 1),
                        "must be null (save at the end only) or an int >= 1 (train steps)"),
    "keep": _rule(lambda v: _is_int(v) and v >= 0, "must be an int >= 0 (0 keeps every checkpoint)"),
    "format": _rule(lambda v: v in FORMATS, f"must be one of {list(FORMATS)}"),
    "async_save": _rule(lambda v: isinstance(v, bool), "must be true or false"),
}


def check_settings(settings, source: str = "settings") -> dict:
    """Validate a settings mapping (the content of a settings file); return a new dict with the keys
    given, and ``checkpoint`` always present, with its defaults filled in.

    Raises:
        ConfigError: naming ``source``, the key, the value and the rule.
    """
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise ConfigError(f"{source}: must be a mapping of settings, got {type(settings).__name__} {settings!r}")
    out = {}
    for key, value in settings.items():
        if key == "checkpoint":
            out[key] = _check_section(value, CHECKPOINT_KEYS, source, "checkpoint")
        elif key in PREPARE_KEYS:
            out[key] = _check(PREPARE_KEYS[key], value, source, key)
        else:
            raise ConfigError(f"{source}: unknown key {key!r} (value {value!r}); the keys are "
                              f"{sorted([*PREPARE_KEYS, 'checkpoint'])}")
    if "param_dtype" in out or "reduce_dtype" in out:
        try:
            MixedPrecision.parse(out.get("param_dtype"), out.get("reduce_dtype"))
        except ValueError as err:
            key = "reduce_dtype" if str(err).startswith("reduce_dtype") else "param_dtype"
            raise ConfigError(f"{source}: key {key!r}: value {out.get(key)!r}: {err}") from None
    out["checkpoint"] = {**CHECKPOINT_DEFAULTS, **out.get("checkpoint", {})}
    return out


def _check(check, value, source, key):
    try:
        return check(value)
    except ValueError as err:
        raise ConfigError(f"{source}: key {key!r}: value {value!r}: {err}") from None


def _check_section(section, keys, source, name):
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: key {name!r}: value {section!r}: must be a mapping with keys {sorted(keys)}")
    out = {}
    for key, value in section.items():
        if key not in keys:
            raise ConfigError(f"{source}: unknown key '{name}.{key}' (value {value!r}); the keys of {name!r} are "
                              f"{sorted(keys)}")
        out[key] = _check(keys[key], value, source, f"{name}.{key}")
    return out


def load_config(path, section: str = None) -> dict:
    """Read and validate a mindzero settings file (YAML).

    Args:
        path: the file.
        section: ``None`` if the whole file is mindzero's settings; else the top-level key under which
            they are (e.g. ``"zero"`` in an application's own config file; the other keys are left alone).

    Returns:
        ``{key: value}`` for the keys given, and ``"checkpoint"``: ``{"dir", "save_every", "keep",
        "format"}`` with defaults filled in. Pass it as ``prepare_train_network(net, opt, config=...)``
        and ``ZeroCheckpoint(train_net, config=...)``.

    Raises:
        ConfigError: an unreadable file, YAML that does not parse, or a key that breaks a rule.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the settings file: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    source = str(path)
    if section is not None:
        if not isinstance(data, dict) or section not in data:
            raise ConfigError(f"{path}: no top-level key {section!r} (the mindzero settings section)")
        data, source = data[section], f"{path} [{section}]"
    return check_settings(data, source)


def resolve_settings(config) -> dict:
    """``config`` as ``prepare_train_network`` / ``ZeroCheckpoint`` accept it: a path (str or Path) to a
    settings file, or a mapping (validated here unless it is already :func:`load_config`'s result)."""
    if isinstance(config, (str, Path)):
        return load_config(config)
    return check_settings(config, "config")

"""mindzero's settings file: the :func:`mindzero.prepare_train_network` options, and the ``checkpoint``
options of :class:`mindzero.ZeroCheckpoint`, in YAML (or a dict). Pure: no MindSpore needed.

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

Every key is optional. The keys are the names of ``prepare_train_network``'s options that a file can hold
(``network``, ``optimizer`` and the group names cannot; ``hybrid_shard_size`` stands for the groups), plus
``checkpoint``. This module only reads the file: every value is checked by the policy that parses it for
the keyword arguments too (:mod:`mindzero.core.config`); a bad one raises :class:`ConfigError` naming the
file, the key, the value and that policy's rule.
"""
from __future__ import annotations

from pathlib import Path

from .config import EmaPolicy, MixedPrecision, check_option
from .options import CheckpointOptions
from .offload import OffloadPolicy
from .options import ARGUMENT_DEFAULTS, NOT_IN_SETTINGS

SETTING_KEYS = tuple(k for k in ARGUMENT_DEFAULTS if k not in NOT_IN_SETTINGS)
CHECKPOINT_DEFAULTS = CheckpointOptions().as_dict()


class ConfigError(ValueError):
    """A settings file or dict breaks a rule; the message names the source, the key, the value and the rule."""


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
            out[key] = _check_checkpoint(value, source)
        elif key in SETTING_KEYS:
            _check(lambda: check_option(key, value), source, key, value)
            out[key] = value
        else:
            raise ConfigError(f"{source}: unknown key {key!r} (value {value!r}); the keys are "
                              f"{sorted([*SETTING_KEYS, 'checkpoint'])}")
    for pair, parse in ((("param_dtype", "reduce_dtype"), MixedPrecision.parse), (("ema", "updates"), EmaPolicy.parse),
                        (("optimizer_offload", "offload_dir"), OffloadPolicy.parse)):
        if any(k in out for k in pair):  # the rule that joins the two
            first = pair[1] if pair[1] in out and pair[0] not in out else pair[0]
            _check(lambda: parse(*(out.get(k, ARGUMENT_DEFAULTS[k]) for k in pair)), source, first, out.get(first))
    out["checkpoint"] = {**CHECKPOINT_DEFAULTS, **out.get("checkpoint", {})}
    return out


def _check(run, source, key, value):
    try:
        run()
    except ValueError as err:
        raise ConfigError(f"{source}: key {key!r}: value {value!r}: {err}") from None


def _check_checkpoint(section, source) -> dict:
    keys = CheckpointOptions.keys()
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: key 'checkpoint': value {section!r}: must be a mapping with keys {sorted(keys)}")
    for key, value in section.items():
        if key not in keys:
            raise ConfigError(f"{source}: unknown key 'checkpoint.{key}' (value {value!r}); the keys of 'checkpoint' "
                              f"are {sorted(keys)}")
        _check(lambda: CheckpointOptions(**{key: value}), source, f"checkpoint.{key}", value)
    return dict(section)


def load_config(path, section: str = None) -> dict:
    """Read and validate a mindzero settings file (YAML).

    Args:
        path: the file.
        section: ``None`` if the whole file is mindzero's settings; else the top-level key under which
            they are (e.g. ``"zero"`` in an application's own config file; the other keys are left alone).

    Returns:
        ``{key: value}`` for the keys given, and ``"checkpoint"``: ``{"dir", "save_every", "keep",
        "format", "async_save"}`` with defaults filled in. Pass it as ``prepare_train_network(net, opt,
        config=...)`` and ``ZeroCheckpoint(config=...)``.

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

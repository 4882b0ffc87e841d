"""Engine configuration: `config.toml` (or a dict) merged over the documented defaults.

The defaults live in the repository's `config.toml`, mirrored by `StrataConfig` and its sections' dataclasses
(strata.config_sections). Every key is validated: an unknown key, a wrong type or an out-of-range value is a
`ConfigError` naming the key, and a key written where an earlier strata kept it is one naming where it lives.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from strata.config_sections import (
    DebugConfig,
    EngramTierConfig,
    PlannerConfig,
    PolicyConfig,
    PrefetchConfig,
    RuntimeConfig,
    StoreConfig,
    TiersConfig,
)
from strata.config_values import parse_gpus, parse_size  # noqa: F401 - strata.config's API too (tests)
from strata.errors import ConfigError

# Keys that moved to [debug], by their old place: a config naming one there is an error that says where it went.
MOVED_KEYS = {f"runtime.{key}": key for key in ("cuda_graphs", "split_decode", "warm_ahead", "overlap_decode",
                                                 "grouped_prefill")}
MOVED_KEYS.update({f"engram.{key}": f"engram_{key}" for key in ("prefetch", "read_batch", "zero_copy", "graph_wait")})
REMOVED_KEYS = {"runtime.read_in_place": "the GPU's share of cold experts is read in place by one-graph split decode",
                "runtime.copy_ahead": "[debug] warm_ahead is the read-ahead one-graph split decode keeps"}


@dataclass
class StrataConfig:
    """The whole configuration; later sections (server) extend it."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    engram: EngramTierConfig = field(default_factory=EngramTierConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every section as nested dicts (TOML-shaped)."""
        return asdict(self)


def load_config(config: str | os.PathLike | dict | StrataConfig | None = None) -> StrataConfig:
    """Build the configuration from a TOML path, a dict of sections, or None (all defaults)."""
    if isinstance(config, StrataConfig):
        return config
    if config is None:
        data: dict = {}
    elif isinstance(config, dict):
        data = config
    else:
        path = Path(config).expanduser()
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
    return _build(StrataConfig, data, "")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from `data`, recursing into sections, rejecting unknown keys."""
    where = prefix.rstrip(".") or "configuration"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table of keys, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if f"{prefix}{key}" in MOVED_KEYS:
            raise ConfigError(f"{prefix}{key} moved to [debug] {MOVED_KEYS[prefix + key]}; set it there")
        if f"{prefix}{key}" in REMOVED_KEYS:
            raise ConfigError(f"{prefix}{key} no longer exists ({REMOVED_KEYS[prefix + key]}); remove it")
        if key not in known:
            raise ConfigError(f"unknown config key '{prefix}{key}'; known keys: {', '.join(known)}")
        f = known[key]
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if hasattr(default, "__dataclass_fields__"):
            kwargs[key] = _build(type(default), value, f"{prefix}{key}.")
            continue
        if f.metadata.get("size"):
            # sizes take "24GiB"/"auto" or a plain number of bytes; the section validates the value
            if isinstance(value, bool) or not isinstance(value, str | int):
                raise ConfigError(f"config key {prefix}{key} must be a size such as \"24GiB\", got {value!r}")
            kwargs[key] = value
            continue
        if f.metadata.get("auto_or_bool") or f.metadata.get("auto_or_int") or f.metadata.get("auto_or_number"):
            # "auto" or a value: the section checks it
            kwargs[key] = value
            continue
        expected = type(default)
        if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"config key {prefix}{key} must be an integer, got {value!r}")
        if expected is str and not isinstance(value, str):
            raise ConfigError(f"config key {prefix}{key} must be a string, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)

"""Engine configuration: `config.toml` (or a dict) merged over the documented defaults.

The defaults live in the repository's `config.toml`, mirrored by the dataclasses below. Every key is
validated: an unknown key, a wrong type or an out-of-range value is a `ConfigError` naming the key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from strata.errors import ConfigError

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICE_NAMES = ("auto", "cpu", "cuda")


@dataclass
class RuntimeConfig:
    """[runtime]: where and how the model runs."""

    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA), "float32", "bfloat16", "float16"
    max_context: int = 4096  # tokens per sequence (prompt + generated), capped by the model's own limit
    prefill_chunk: int = 512  # prompt tokens per forward pass during prefill (bounds activation memory)
    threads: int = 0  # torch CPU threads; 0 = torch's default (one per physical core)

    def __post_init__(self) -> None:
        if self.device not in DEVICE_NAMES and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"runtime.device = {self.device!r} is invalid; use one of {', '.join(DEVICE_NAMES)} or cuda:N")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"runtime.dtype = {self.dtype!r} is invalid; use one of {', '.join(DTYPE_NAMES)}")
        for key, low in (("max_context", 16), ("prefill_chunk", 1), ("threads", 0)):
            value = getattr(self, key)
            if value < low:
                raise ConfigError(f"runtime.{key} = {value} is out of range; it must be >= {low}")


@dataclass
class StrataConfig:
    """The whole configuration; later sections (tiers, policy, prefetch, server) extend it."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: {g.name: getattr(getattr(self, f.name), g.name) for g in fields(getattr(self, f.name))} for f in fields(self)}


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
        if key not in known:
            raise ConfigError(f"unknown config key '{prefix}{key}'; known keys: {', '.join(known)}")
        f = known[key]
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if hasattr(default, "__dataclass_fields__"):
            kwargs[key] = _build(type(default), value, f"{prefix}{key}.")
            continue
        expected = type(default)
        if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"config key {prefix}{key} must be an integer, got {value!r}")
        if expected is str and not isinstance(value, str):
            raise ConfigError(f"config key {prefix}{key} must be a string, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)

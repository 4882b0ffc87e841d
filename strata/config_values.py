"""Config values richer than their TOML type: byte sizes ("24GiB", "auto"), GPU index lists ("0,1") and switches
that take "auto" or a bool, each parsed or checked with a `ConfigError` naming its key."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

from strata.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str | int, key: str, allow_auto: bool = True) -> int | None:
    """A byte size from config: "auto" -> None, an int, or a number with a unit ("24GiB", "1.5GB", "0").

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024).
    `key` names the config key in the error message.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{key} = {value} is negative; use a size such as \"24GiB\" or 0")
        return value
    hint = '"24GiB", "512MiB" or "auto"' if allow_auto else '"2GiB", "512MiB" or "0"'
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            if allow_auto:
                return None
            raise ConfigError(f'{key} cannot be "auto"; give a size, e.g. {hint}')
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m[1]) * _UNITS[(m[2] or "b").lower()])
    shown = f'"{value}"' if isinstance(value, str) else repr(value)  # TOML's quoting, as the user wrote it
    raise ConfigError(f"{key} = {shown} is not a size; use e.g. {hint}")


def size_field(default: str) -> Any:
    """A dataclass field holding a size: a string ("24GiB", "auto") or an int of bytes."""
    return field(default=default, metadata={"size": True})


def parse_gpus(text: str, key: str = "--gpus") -> list[int]:
    """"0,1" -> [0, 1] for `--gpus` (checked like runtime.devices once set on the config)."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"{key} {text!r} is not a list of GPU indices; use e.g. {key} 0,1") from None


def check_auto_or_bool(key: str, value: Any) -> None:
    """A switch that takes "auto", true or false: anything else is a `ConfigError` naming `key`."""
    if not isinstance(value, bool) and value != "auto":
        raise ConfigError(f'{key} = {value!r} is invalid; use "auto", true or false')

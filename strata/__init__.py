"""strata: serve Mixture-of-Experts models much larger than the GPU, each expert in the tier it earns.

`Engine` and `GenerationOutput` are imported on first use (PEP 562), so `import strata` (and with it
`strata --version` / `strata --help`) does not pay for importing torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from strata.errors import CheckpointError, ConfigError, RequestError, StrataError, UnsupportedError

if TYPE_CHECKING:
    from strata.engine import Engine
    from strata.outputs import GenerationOutput

try:
    __version__: str = version("strata-moe")  # pyproject.toml's [project] version, the one source of it
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {"Engine": "strata.engine", "GenerationOutput": "strata.outputs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Engine",
    "GenerationOutput",
    "StrataError",
    "CheckpointError",
    "ConfigError",
    "RequestError",
    "UnsupportedError",
    "__version__",
]

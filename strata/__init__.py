"""strata: serve Mixture-of-Experts models much larger than the GPU, each expert in the tier it earns."""

from strata.engine import Engine, GenerationOutput
from strata.errors import CheckpointError, ConfigError, RequestError, StrataError, UnsupportedError

__version__ = "0.1.0"

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

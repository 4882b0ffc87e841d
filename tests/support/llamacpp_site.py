"""Where llama-cpp-python is, for the optional tests that hold strata's GGUF output to llama.cpp itself: importable
here, or the private install bench/cpu/cpu_vs_llamacpp.py builds under ~/.cache/strata/bench. Not a dependency: the
tests that use it are skipped without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def llamacpp_site() -> Path | None:
    """The directory holding the `llama_cpp` package (put it on sys.path or PYTHONPATH), or None."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent.parent
    found = sorted((Path.home() / ".cache" / "strata" / "bench").glob("llama-cpp-python-*/site"))
    return next((p for p in reversed(found) if (p / "llama_cpp" / "__init__.py").is_file()), None)


def ggml_base_library() -> Path | None:
    """llama.cpp's libggml-base shared library (its reference quantizers are exported), or None."""
    site = llamacpp_site()
    if site is None:
        return None
    return next(iter(sorted((site / "llama_cpp" / "lib").glob("libggml-base.*"))), None)

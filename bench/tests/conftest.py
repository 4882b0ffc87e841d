"""Fixtures of the benchmark tools' own tests: a private strata cache and the tiny demo model."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def strata_cache(tmp_path_factory):
    """Stores built on first use go to a temporary cache, not the user's ~/.cache/strata
    (tests/support/private_cache.py)."""
    from private_cache import private_strata_cache

    with private_strata_cache(tmp_path_factory.mktemp("strata-cache")):
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", progress=False)

"""Shared fixtures: the tiny demo model (written once per session) and an engine on it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import reference_models


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def strata_cache(tmp_path_factory):
    """Stores built on first use go to a temporary cache, not the user's ~/.cache/strata."""
    import os

    path = tmp_path_factory.mktemp("strata-cache")
    old = os.environ.get("STRATA_CACHE")
    os.environ["STRATA_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("STRATA_CACHE", None)
    else:
        os.environ["STRATA_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from strata.runtime.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from strata import Engine

    return Engine.from_pretrained(tiny_model_dir, device="cpu")

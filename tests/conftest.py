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
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from strata import Engine

    return Engine.from_pretrained(tiny_model_dir, device="cpu")


@pytest.fixture(scope="session")
def engram6_dir(tmp_path_factory) -> Path:
    """The tiny demo model with 6 layers and Engram layers 1 and 4 (one per stage of a two-stage split)."""
    from strata.runtime.demo import engram as engram_demo
    from strata.runtime.demo.model import write_demo_model

    saved = engram_demo._SIZES["tiny"]
    engram_demo._SIZES["tiny"] = ([1, 4], *saved[1:])
    try:
        return write_demo_model(tmp_path_factory.mktemp("engram6") / "tiny6e", size="tiny", layers=6, progress=False)
    finally:
        engram_demo._SIZES["tiny"] = saved

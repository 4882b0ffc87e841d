"""Shared fixtures: the tiny demo model (written once per session) and an engine on it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))  # reference_models and the other builders


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def strata_cache(tmp_path_factory):
    """Stores built on first use go to a temporary cache, not the user's ~/.cache/strata
    (tests/support/private_cache.py)."""
    from private_cache import private_strata_cache

    with private_strata_cache(tmp_path_factory.mktemp("strata-cache")) as path:
        yield path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """An engine on the tiny model in float32, the exact path the tests compare against references."""
    from strata import Engine

    return Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {"dtype": "float32"}})


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


@pytest.fixture(scope="module")
def tiny6_dir(tmp_path_factory) -> Path:
    """The tiny demo model with 6 layers (1 dense + 5 MoE), no Engram: enough layers for 2-4 stages."""
    from strata.runtime.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo6") / "tiny6", size="tiny", layers=6, engram=False,
                            progress=False)


@pytest.fixture(scope="module")
def staged_tiered(tiny6_dir):
    """The tiered tiny6 model over two CPU stages (layers 0-2 and 3-5), each with a simulated GPU tier of 8 slots."""
    from strata.config import load_config
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.plan.build import ensure_store
    from strata.runtime.plan.multi_device import assemble_tiered
    from strata.tiers.slots import TierBudgets

    cpu = torch.device("cpu")
    cfg = load_config({"runtime": {"cpu_numerics": "gpu", "max_context": 64}, "prefetch": {"lookahead": 1},
                       "tiers": {"disk": {"scrub": False}}})
    store = ensure_store(tiny6_dir, cfg, False)
    loaded = assemble_tiered(Checkpoint.open(store), [(cpu, 0, 3), (cpu, 3, 6)], [8, 8],
                             TierBudgets(gpu_slots=16, pinned_slots=20), cfg, torch.float32)
    yield loaded
    loaded.manager.close()

"""Fixtures the planner's tests share."""

from __future__ import annotations

import pytest
from test_inspect import qwen3_moe, write_sparse_checkpoint

from strata.runtime.demo.model import demo_config


@pytest.fixture(scope="session")
def q30b_multi(tmp_path_factory):
    """A sparse checkpoint of Qwen3-30B-A3B's shape (48 layers of 128 experts), no Engram: several cards' plans."""
    spec, _ = qwen3_moe(48, 2048, 32, 768, 128, fused=True)
    d = tmp_path_factory.mktemp("q30b-multi") / "m"
    write_sparse_checkpoint(d, spec, demo_config("bench", engram=False), shards=4)
    return d

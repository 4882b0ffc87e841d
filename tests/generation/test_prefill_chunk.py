"""runtime.prefill_chunk = "auto": the chunk a prefill pass takes, from the model's shape and the activation reserve."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.config import load_config
from strata.errors import ConfigError
from strata.runtime.demo.model import demo_config
from strata.runtime.generation.prefill_chunk import (
    activation_bytes_per_token,
    auto_prefill_chunk,
    piece_bytes,
    resolve_prefill_chunk,
    score_chunk,
)
from strata.runtime.model.config import ModelConfig

GiB = 2**30
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing is allocated


@pytest.fixture(scope="module")
def bench():
    """Qwen3-30B-A3B's shape (the `bench` demo model)."""
    return ModelConfig.from_hf(demo_config("bench", engram=False))


def test_the_estimate_stays_above_what_the_bench_model_measured(bench):
    per_token = activation_bytes_per_token(bench)
    # measured 110-122 KiB a chunk token beyond the start on the H200, with one piece's temporaries (~110 MiB)
    assert 125 * 1024 < per_token < 400_000  # generous, not absurd
    assert 50 * 2**20 < piece_bytes(bench) < 400 * 2**20
    wider = ModelConfig.from_hf({**demo_config("bench", engram=False), "hidden_size": 7168, "moe_intermediate_size": 2048})
    assert activation_bytes_per_token(wider) > 2 * per_token


def test_auto_fills_three_quarters_of_the_reserve_in_steps_of_512_up_to_8192(bench):
    per_token = activation_bytes_per_token(bench)
    room = 0.75 * GiB - piece_bytes(bench)  # three quarters of a 1 GiB reserve, less one piece's temporaries
    chunk = auto_prefill_chunk(bench, CUDA, GiB, 32768)
    assert chunk % 512 == 0 and chunk * per_token <= room < (chunk + 512) * per_token
    # the default reserve: an 8K prompt in one pass (every cold expert crosses PCIe once)
    assert auto_prefill_chunk(bench, CUDA, 2 * GiB, 32768) == 8192
    assert auto_prefill_chunk(bench, CUDA, 64 * GiB, 32768) == 8192
    assert auto_prefill_chunk(bench, CUDA, 64 * GiB, 3000) == 3000  # never past the context
    assert auto_prefill_chunk(bench, CUDA, 0, 32768) == 512  # a reserve too small still prefills
    assert auto_prefill_chunk(bench, CPU, 64 * GiB, 32768) == 512  # host memory, no copies to save
    assert auto_prefill_chunk(bench, CUDA, GiB, 32768) > auto_prefill_chunk(bench, CUDA, GiB // 2, 32768)


def test_a_number_is_kept_and_score_bounds_its_logits(bench):
    assert resolve_prefill_chunk(300, bench, CUDA, 2 * GiB, 4096) == 300
    assert resolve_prefill_chunk("auto", bench, CPU, 2 * GiB, 4096) == 512
    assert score_chunk(5120, 151_936, 2 * GiB) == 2 * GiB // 2 // (12 * 151_936)  # Qwen's vocabulary: 588
    assert score_chunk(5120, 8192, 2 * GiB) == 5120  # a small vocabulary leaves the chunk alone
    assert score_chunk(512, 10**9, 0) == 1


@pytest.mark.parametrize("value", ["big", 0, True, 1.5])
def test_bad_chunks_are_refused(value):
    with pytest.raises(ConfigError, match="runtime.prefill_chunk"):
        load_config({"runtime": {"prefill_chunk": value}})


def test_the_engine_uses_the_resolved_chunk(tiny_model_dir):
    exact = {"experts": "memory", "dtype": "float32"}  # chunks change only the summation order
    auto = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": exact})
    assert auto.config.runtime.prefill_chunk == "auto" and auto.prefill_chunk == 512
    small = Engine.from_pretrained(tiny_model_dir, device="cpu", config={"runtime": {**exact, "prefill_chunk": 4}})
    assert small.prefill_chunk == 4 and small.scheduler(max_batch=1).repro_chunk == 4
    ids = auto.tokenizer.encode("The river runs through the valley and the town")
    assert len(ids) > 4
    torch.testing.assert_close(small.score(ids), auto.score(ids), atol=1e-4, rtol=1e-4)  # chunked attention agrees
    assert small.generate(ids, max_tokens=6).token_ids == auto.generate(ids, max_tokens=6).token_ids

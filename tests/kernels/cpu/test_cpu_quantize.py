"""strata.kernels.cpu.quantize: the compiled K-quant quantizers write the bytes of the numpy port of ggml-quants.c
(strata.tiers.store.gguf_quantize.quantize_rows_reference, itself held to ggml's own code where llama.cpp's library
is present) on inputs that reach every branch of the searches: Gaussian rows at weight scale, heavy tails, sparse and
all-zero sub-blocks, constant rows of either sign, tiny and huge magnitudes, and small integers (ties of the
rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.kernels.cpu.library import library
from strata.kernels.cpu.quantize import TYPE_IDS, quantize_rows
from strata.tiers.store import gguf_quantize

pytestmark = pytest.mark.skipif(library() is None, reason="the CPU library cannot be built here")


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n = (16, 512)
    return {
        "weights": rng.standard_normal((64, 2048)) * 0.02,
        "heavy tails": rng.standard_t(3, n),
        "outliers": rng.standard_normal(n) * (1 + 100 * (rng.random(n) < 0.01)),
        "sparse": np.where(rng.random(n) < 0.95, 0.0, rng.standard_normal(n)),
        "half zero": np.concatenate([np.zeros((8, 256)), rng.standard_normal((8, 256))], axis=1),
        "zeros": np.zeros((2, 512)),
        "positive constant": np.full((2, 512), 0.3),
        "negative constant": np.full((2, 512), -0.3),
        "all positive": np.abs(rng.standard_normal(n)),
        "tiny": rng.standard_normal(n) * 1e-6,
        "huge": rng.standard_normal(n) * 1e4,
        "small integers": rng.integers(-3, 4, n),
    }


@pytest.mark.parametrize("type_name", sorted(TYPE_IDS))
def test_the_compiled_bytes_are_the_references(type_name):
    for name, x in _inputs().items():
        x = x.astype(np.float32)
        got = quantize_rows(x, type_name)
        want = gguf_quantize.quantize_rows_reference(x, type_name)
        assert got is not None and got.shape == want.shape, name
        diff = np.argwhere(got != want)
        assert diff.size == 0, f"{type_name} on {name}: {len(diff)} bytes differ, first at {diff[0].tolist()}"


def test_quantize_rows_takes_the_compiled_path_and_keeps_the_leading_shape():
    x = np.random.default_rng(3).standard_normal((2, 3, 512)).astype(np.float32)
    out = gguf_quantize.quantize_rows(x, "Q4_K")
    assert out.shape == (2, 3, 2 * 144)
    assert np.array_equal(out, quantize_rows(x, "Q4_K"))
    assert np.array_equal(out.reshape(6, -1), gguf_quantize.quantize_rows_reference(x.reshape(6, 512), "Q4_K"))


def test_types_and_widths_not_compiled_here_are_left_to_numpy():
    x = np.zeros((2, 512), dtype=np.float32)
    assert quantize_rows(x, "Q8_0") is None and quantize_rows(x, "IQ4_XS") is None
    assert quantize_rows(np.zeros((2, 96), dtype=np.float32), "Q4_K") is None

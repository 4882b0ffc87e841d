"""strata.tiers.store.gguf_quantize: llama.cpp's reference quantizers (compiled, and their numpy port). Dequantized by `gguf` (llama.cpp's own
numpy code) the blocks are close to the input, by each type's measured error; they survive a GGUF file and its
reader byte for byte; quantizing a dequantized matrix again changes it little (not at all for Q8_0, Q4_K and
Q6_K); and, where llama.cpp's library is present, they are the bytes its quantize_row_*_ref functions write."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from strata.errors import UnsupportedError
from strata.tiers.store.gguf_quantize import QUANTIZED_TYPES, block_shape, quantize_rows, quantize_rows_reference

gguf = pytest.importorskip("gguf")

from llamacpp_site import ggml_base_library  # noqa: E402

# relative RMS error on N(0, 1) rows, measured 0.00535, 0.2967, 0.0713, 0.0361, 0.0177 (llama.cpp's reference
# quantizers give the same); a quantizer that skips the scale search or misplaces a nibble lands above these
MAX_REL_RMS = {"Q8_0": 0.0056, "Q2_K": 0.31, "Q4_K": 0.075, "Q5_K": 0.038, "Q6_K": 0.0185}
# requantizing the dequantized matrix: Q2_K measured 0.0066 and Q5_K 0.0031 of its scale (2% and 9% of the first
# pass's error; their scale searches find another fit for some sub-blocks), the others exactly the same values
MAX_REQUANT = {"Q8_0": 0.0, "Q2_K": 0.02, "Q4_K": 0.0, "Q5_K": 0.006, "Q6_K": 0.0}


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


def _dequantize(blocks: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name])


@pytest.fixture(scope="module")
def gaussian() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_dequantized_blocks_are_close_to_the_input(gaussian, type_name):
    blocks = quantize_rows(gaussian, type_name)
    values, nbytes = block_shape(type_name)
    assert blocks.dtype == np.uint8 and blocks.shape == (256, 1024 // values * nbytes)
    assert _rel_rms(_dequantize(blocks, type_name), gaussian) < MAX_REL_RMS[type_name]
    # the scales follow the data: at the demo models' weight scale (N(0, 0.02)) the same relative error
    small = _dequantize(quantize_rows(gaussian * 0.02, type_name), type_name)
    assert _rel_rms(small, gaussian * 0.02) < MAX_REL_RMS[type_name]


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_requantizing_a_dequantized_matrix_changes_it_little(gaussian, type_name):
    once = _dequantize(quantize_rows(gaussian, type_name), type_name)
    twice = _dequantize(quantize_rows(once, type_name), type_name)
    assert _rel_rms(twice, once) <= MAX_REQUANT[type_name]


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_zero_and_constant_rows(type_name):
    x = np.zeros((3, 512), dtype=np.float32)
    x[1] = 0.25
    x[2, :16] = -1.0  # one sub-block of values, the rest zero
    with np.errstate(all="raise"):  # no division by a zero scale anywhere
        back = _dequantize(quantize_rows(x, type_name), type_name)
    assert np.array_equal(back[0], x[0])
    assert np.allclose(back[1:], x[1:], atol=0.01)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_blocks_round_trip_through_a_gguf_file(gaussian, tmp_path, type_name):
    experts = gaussian.reshape(4, 64, 1024)  # [E, rows, K], as a layer's stacked experts
    blocks = quantize_rows(experts, type_name)
    qtype = gguf.GGMLQuantizationType[type_name]
    w = gguf.GGUFWriter(tmp_path / "q.gguf", "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (t,) = gguf.GGUFReader(tmp_path / "q.gguf").tensors
    assert t.tensor_type == qtype
    assert [int(d) for d in t.shape] == [1024, 64, 4]  # ggml's order: K first
    assert np.array_equal(np.asarray(t.data).reshape(blocks.shape), blocks)


def test_a_row_that_does_not_split_into_blocks_is_refused():
    with pytest.raises(UnsupportedError, match="rows of 96 values do not split into Q4_K blocks of 256"):
        quantize_rows(np.zeros((2, 96), dtype=np.float32), "Q4_K")
    with pytest.raises(UnsupportedError, match="IQ4_XS is not one strata quantizes to"):
        quantize_rows(np.zeros((2, 256), dtype=np.float32), "IQ4_XS")


@pytest.mark.parametrize("quantize", [quantize_rows, quantize_rows_reference], ids=["default", "numpy"])
@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_the_bytes_are_llamacpps(type_name, quantize):
    """Against ggml's own quantize_row_*_ref (llama-cpp-python's library, when present): the same float32
    operations in the same order give the same bytes, on Gaussian, heavy-tailed, sparse and zero sub-blocks, from
    the compiled quantizers `quantize_rows` runs and from their numpy port."""
    lib_path = ggml_base_library()
    if lib_path is None:
        pytest.skip("llama-cpp-python is not installed (optional; bench/cpu/cpu_vs_llamacpp.py builds it)")
    lib = ctypes.CDLL(str(lib_path))
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal((64, 1024)) * 0.02, rng.standard_t(3, (64, 1024)),
                        np.where(rng.random((64, 1024)) < 0.9, 0.0, rng.standard_normal((64, 1024))),
                        np.zeros((1, 1024)), np.full((1, 1024), 0.5)]).astype(np.float32)
    values, nbytes = block_shape(type_name)
    ref = np.zeros(x.size // values * nbytes, dtype=np.uint8)
    fn = getattr(lib, f"quantize_row_{type_name.lower().replace('_k', '_K')}_ref")
    fn(x.ctypes.data_as(ctypes.c_void_p), ref.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    ours = quantize(x, type_name)
    assert np.array_equal(ours.reshape(-1, nbytes), ref.reshape(-1, nbytes))

"""The CPU dense kernel (strata.kernels.cpu.dense): a decode step's bf16 projections on the expert kernel's pool,
checked against the fp32 product of the same bf16 values."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import dense
from strata.kernels.cpu import experts as ce

BACKENDS = [b for b in ("avx512_bf16", "avx512", "avx2") if ce.available_isa(b)]
pytestmark = pytest.mark.skipif(not BACKENDS, reason="the compiled CPU kernel is not available here")


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16())


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()  # every bf16 product is exact; the sums in double


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
def test_matches_the_product_of_the_bf16_values(backend, m):
    """Every row count the kernel takes, K with and without a tail past the vector width, N past a chunk and not a
    multiple of the rows read at once: within fp32 summation error of the exact product."""
    for n, k in [(1000, 2048), (37, 100), (4099, 64), (3, 33)]:
        x, w = _case(m, n, k)
        y = dense.linear(x, w, out_dtype=torch.float32, threads=2, backend=backend)
        ref = _reference(x, w)
        scale = (x.float().abs() @ w.float().abs().T).max()  # the sums' magnitude bounds their rounding
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert (y - ref).abs().max() <= 1e-5 * scale, (n, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_thread_count_does_not_change_the_bits(backend):
    x, w = _case(4, 8192, 2048, seed=1)  # 32 MB: many chunks over the pool
    one = dense.linear(x, w, out_dtype=torch.float32, threads=1, backend=backend)
    assert torch.equal(one, dense.linear(x, w, out_dtype=torch.float32, threads=2, backend=backend))
    assert torch.equal(one, dense.linear(x, w, out_dtype=torch.float32, threads=3, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_prefetch_distance_does_not_change_the_bits(backend):
    """The weights are prefetched `configure(prefetch_bytes=)` ahead along their rows (past a chunk's or the matrix's
    end too, which a prefetch may touch): the same sums at every distance, none."""
    from strata.kernels.cpu import library

    x, w = _case(3, 4104, 2080, seed=2)  # rows of 2,080 values: a step's tail, rows not a whole number of lines
    shipped = library.prefetch_bytes()
    try:
        outs = []
        for pf in (0, 64, 2048, 1 << 20):
            library.configure(prefetch_bytes=pf)
            outs.append(dense.linear(x, w, out_dtype=torch.float32, threads=2, backend=backend))
    finally:
        library.configure(prefetch_bytes=shipped)
    assert all(torch.equal(outs[0], y) for y in outs[1:])


def test_the_prefetch_distance_follows_the_cpu_vendor(monkeypatch):
    """AMD CPUs read without software prefetch (their hardware prefetchers were faster alone), others 2 KiB ahead; the
    vendor is the first CPU's vendor_id line of /proc/cpuinfo."""
    from strata.kernels.cpu import library

    for vendor, want in (("AuthenticAMD", 0), ("GenuineIntel", library.DEFAULT_PREFETCH_BYTES), ("", 2048)):
        monkeypatch.setattr(library, "_first_cpu_info", lambda v=vendor: {"vendor_id": v} if v else {})
        assert library.default_prefetch_bytes() == want
    monkeypatch.undo()
    real = library.cpu_info("vendor_id")
    assert library.default_prefetch_bytes() == library.PREFETCH_BYTES_BY_VENDOR.get(real, 2048)
    if os.path.exists("/proc/cpuinfo"):
        first = open("/proc/cpuinfo").read().split("\n\n")[0]
        assert f"vendor_id\t: {real}" in first or not real
        assert library.cpu_info("no such field") == ""


def test_bf16_output_is_the_fp32_output_rounded_and_bias_is_added():
    x, w = _case(3, 515, 256, seed=2)
    bias = torch.randn(515).bfloat16()
    y32 = dense.linear(x, w, out_dtype=torch.float32)
    assert torch.equal(dense.linear(x, w), y32.bfloat16())  # out_dtype None: x's (bf16), rounded to nearest even
    with_bias = dense.linear(x, w, bias, out_dtype=torch.float32)
    assert torch.equal(with_bias, y32 + bias.float())
    assert torch.equal(dense.linear(x[None], w).squeeze(0), y32.bfloat16())  # leading dims are kept
    close = F.linear(x.float(), w.float(), bias.float())
    assert (with_bias - close).abs().max() < 1e-3 * close.abs().max()


def test_declines_what_it_does_not_compute():
    x, w = _case(2, 64, 128, seed=3)
    assert dense.linear(x.float(), w.float()) is None  # fp32 weights: torch's path
    assert dense.linear(x.float(), w) is None  # activations in another dtype than the weights
    assert dense.linear(torch.randn(dense.MAX_ROWS + 1, 128).bfloat16(), w) is None  # prefill-sized: torch's GEMM
    assert dense.linear(x, w.t().contiguous().t()) is None  # rows not contiguous
    assert dense.linear(x, w, backend="torch") is None
    assert dense.linear(x, w, out_dtype=torch.float16) is None
    wp = torch.nn.Parameter(w.float()).bfloat16().requires_grad_()
    assert dense.linear(x, wp) is None  # autograd wants torch's op

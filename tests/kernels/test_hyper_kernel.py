"""DeepSeek-V4's fused hyper-connection weights (strata.kernels.gpu.hyper) against the torch chain of
strata.runtime.model.deepseek_v4.hyper they replace: the sigmoids, the softmax and every Sinkhorn-Knopp iteration of
`comb`, and the collapse of the streams. On CUDA in bf16 (marked gpu); on the CPU under Triton's interpreter in fp16
(tests/kernels/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch
from fused_device import DEVICE, DTYPE, MARKS

from strata.kernels import options
from strata.kernels.gpu import hyper
from strata.runtime.model.deepseek_v4.hyper import HyperConnection

pytestmark = MARKS


def _connection(n: int, hidden: int, iters: int, seed: int) -> HyperConnection:
    g = torch.Generator().manual_seed(seed)
    hc = HyperConnection(hidden, n, iters, 1e-6, 1e-6)
    with torch.no_grad():  # random where the release's are trained: every weight and sign reaches the kernel
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.02)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.tensor([0.7, -1.3, 2.1]))
    return hc.to(DEVICE)


def _streams(rows: int, n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, n, hidden, generator=torch.Generator().manual_seed(seed)).to(DTYPE).to(DEVICE)


@pytest.mark.parametrize(("rows", "n", "hidden", "iters"), [(1, 4, 2048, 20), (3, 4, 300, 20), (2, 3, 1100, 5),
                                                            (2, 4, 64, 1)])
def test_the_fused_weights_are_the_torch_chains(rows, n, hidden, iters):
    """One token or several, the released shape (4 streams, 20 iterations), a stream count that pads the kernel's
    blocks (3), a hidden size not a multiple of its tile (300, 1100), and a single normalisation (iters 1)."""
    hc, streams = _connection(n, hidden, iters, seed=rows + n), _streams(rows, n, hidden, seed=hidden)
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
        with options.kernel_options(options.KernelOptions(fused=False)):
            ref_post, ref_comb, ref_collapsed = hc(streams)
    assert post.shape == (rows, n) and comb.shape == (rows, n, n) and collapsed.shape == (rows, hidden)
    torch.testing.assert_close(post, ref_post, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
    # the collapse sums the same fp32 products in the same order and rounds once: at most a rounding step apart
    assert collapsed.dtype == DTYPE
    torch.testing.assert_close(collapsed.float(), ref_collapsed.float(), rtol=2 ** -7, atol=1e-3)
    assert (collapsed != ref_collapsed).float().mean().item() < 0.05
    # doubly stochastic after the iterations: the columns sum to ~1 (the last normalisation's), the rows near it
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(rows, n, device=DEVICE), rtol=0, atol=1e-4)


def test_the_fused_kernel_steps_aside():
    """Off with the fused kernels (`[debug] fused_kernels = false`), for more streams than its registers hold and for
    weights not in fp32: the torch chain runs (None)."""
    hc, streams = _connection(4, 64, 20, seed=0), _streams(2, 4, 64, seed=1)
    mixes = torch.zeros(2, 24, device=DEVICE)
    assert hyper.hyper_weights(mixes, hc.base, hc.scale, streams, 20, 1e-6) is not None
    with options.kernel_options(options.KernelOptions(fused=False)):
        assert hyper.hyper_weights(mixes, hc.base, hc.scale, streams, 20, 1e-6) is None
    assert hyper.hyper_weights(mixes.half(), hc.base, hc.scale, streams, 20, 1e-6) is None
    wide = _streams(1, hyper.MAX_STREAMS + 1, 64, seed=2)
    n = hyper.MAX_STREAMS + 1
    assert hyper.hyper_weights(torch.zeros(1, (2 + n) * n, device=DEVICE), torch.zeros((2 + n) * n, device=DEVICE),
                               hc.scale, wide, 20, 1e-6) is None

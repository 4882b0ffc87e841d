"""The split-KV decode attention kernel's options (strata.kernels.gpu.decode_attention): gpt-oss's attention sinks
(SINKS, in the merge) with and without a sliding window (WINDOW), against torch's decode attention with sinks
(`gpt_oss.attention.attend_decode_sinks`). On CUDA in bf16 (marked gpu); on CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, as tests/kernels/test_kernels_interpreted.py runs this module) in fp16."""

from __future__ import annotations

import pytest
import torch
from fused_device import DEVICE, DTYPE, MARKS

from strata.kernels.gpu import decode_attention as da
from strata.runtime.model.gpt_oss.attention import attend_decode_sinks

pytestmark = MARKS


def _inputs(batch: int, heads: int, kv_heads: int, d: int, length: int, seed: int):
    """q [B, heads, d], caches [5, length, kv_heads, d], slots [B], positions [B] (the last, 0, 3, the middle)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(5, length, kv_heads, d, generator=g).to(DTYPE).to(DEVICE)
    vc = torch.randn(5, length, kv_heads, d, generator=g).to(DTYPE).to(DEVICE)
    q = torch.randn(batch, heads, d, generator=g).to(DTYPE).to(DEVICE)
    slots = torch.tensor([4, 0, 2, 1][:batch], device=DEVICE)
    pos = torch.tensor([length - 1, 0, 3, length // 2][:batch], device=DEVICE)
    return q, kc, vc, slots, pos


@pytest.mark.parametrize("batch,heads,kv_heads,d,length,window", [
    (4, 64, 8, 64, 1024, 128),  # gpt-oss-20b's sliding layers: several splits, most of them before the window
    (4, 64, 8, 64, 256, None),  # its full layers, one bucket
    (2, 8, 2, 16, 300, 12),  # the tiny test model's shape: a bucket not a multiple of the block, a 12-token window
])
def test_decode_attention_sinks_equal_torch(batch, heads, kv_heads, d, length, window):
    q, kc, vc, slots, pos = _inputs(batch, heads, kv_heads, d, length, seed=length + heads)
    sinks = (torch.randn(heads, generator=torch.Generator().manual_seed(1)) * 3).to(DTYPE).to(DEVICE)
    assert da.decode_attention_ok(q, kc)
    out = da.decode_attention(q, kc, vc, slots, pos, length, window, d ** -0.5, sinks=sinks)
    ref = attend_decode_sinks(q.float(), kc.float(), vc.float(), slots, pos, length, window, d ** -0.5, sinks)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    # the sequence at position 0 sees one key: its output is that value row, weighted by 1 / (1 + exp(sink - s))
    group = heads // kv_heads
    k0, v0 = kc[0, 0].float().repeat_interleave(group, 0), vc[0, 0].float().repeat_interleave(group, 0)
    s0 = (q[1].float() * k0).sum(-1) * d ** -0.5
    expect = v0 * torch.sigmoid(s0 - sinks.float())[:, None]
    torch.testing.assert_close(out[1].float(), expect, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [None, 100])
def test_a_sink_of_minus_infinity_is_the_plain_build(window):
    """exp(-inf) adds nothing to the merge's denominator: the SINKS build gives the plain build's bits."""
    q, kc, vc, slots, pos = _inputs(3, 16, 2, 64, 700, seed=5)
    plain = da.decode_attention(q, kc, vc, slots, pos, 700, window, 0.125)
    none = torch.full((16,), float("-inf"), dtype=DTYPE, device=DEVICE)
    assert torch.equal(da.decode_attention(q, kc, vc, slots, pos, 700, window, 0.125, sinks=none), plain)
    sunk = da.decode_attention(q, kc, vc, slots, pos, 700, window, 0.125, sinks=torch.zeros_like(none))
    assert (sunk.float().norm(dim=-1) < plain.float().norm(dim=-1)).all()  # a sink of 0 takes a share of the mass

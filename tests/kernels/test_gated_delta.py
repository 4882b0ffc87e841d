"""Qwen3.5's fused decode kernels (strata.kernels.gpu.gated_delta) against the torch chains of
strata.runtime.model.qwen3_5 they replace: the convolution step, the gated delta rule on states gathered by slot
(fresh sequences from zeros), the gated norm and the zero-centred norm. On CUDA in bf16 (marked gpu); on the CPU
under Triton's interpreter in fp16 (tests/kernels/test_kernels_interpreted.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_device import DEVICE, DTYPE, MARKS

from strata.kernels.gpu import gated_delta
from strata.runtime.model.qwen3_5.delta_rule import conv_step, gated_delta_step
from strata.runtime.model.qwen3_5.norms import GatedRMSNorm, ZeroCenteredRMSNorm

pytestmark = MARKS


def close_in_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to a rounding step of the dtype; most elements bit-identical (only sums reorder)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2e-3)
    assert (a != b).float().mean().item() < 0.1


def _layer(seed: int, slots: int = 6, hk: int = 2, hv: int = 4, dk: int = 32, dv: int = 64, kernel: int = 4):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    return {
        "conv": torch.randn(slots, conv_dim, kernel - 1, generator=g).to(DTYPE).to(DEVICE),
        "rec": (torch.randn(slots, hv, dk, dv, generator=g) * 0.3).to(DEVICE),
        "weight": (torch.randn(conv_dim, 1, kernel, generator=g) * 0.5).to(DTYPE).to(DEVICE),
        "a_log": (torch.rand(hv, generator=g) * 2).to(DTYPE).to(DEVICE),
        "dt_bias": torch.randn(hv, generator=g).to(DTYPE).to(DEVICE),
        "gen": g, "hk": hk, "hv": hv, "dk": dk, "dv": dv, "conv_dim": conv_dim,
    }


def _torch_step(L: dict, qkv, a, b, slots, fresh):
    """The torch chain of GatedDeltaNet._step on copies of the states: (outputs, conv, recurrent after)."""
    conv, rec = L["conv"].clone(), L["rec"].clone()
    c, r = conv.index_select(0, slots), rec.index_select(0, slots)
    if fresh is not None:
        c, r = c.masked_fill(fresh[:, None, None], 0), r.masked_fill(fresh[:, None, None, None], 0)
    x = conv_step(qkv, c, L["weight"])
    hk, hv, dk, dv = L["hk"], L["hv"], L["dk"], L["dv"]
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    n = x.shape[0]
    beta = b.sigmoid()
    g = -L["a_log"].float().exp() * F.softplus(a.float() + L["dt_bias"])
    out = gated_delta_step(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g, beta, r)
    conv.index_copy_(0, slots, c)
    rec.index_copy_(0, slots, r)
    return x, out, conv, rec


@pytest.mark.parametrize("dk,dv", [(32, 64), (8, 12)])
@pytest.mark.parametrize("fresh_rows", [None, [True, False, False]])
def test_decode_step_equals_the_torch_chain_on_gathered_slots(fresh_rows, dk, dv):
    """Three sequences in slots 4, 1, 3 of six (one at position 0 where `fresh_rows` says), heads of powers of two
    and not: the fused convolution and delta rule give the torch chain's outputs, move exactly those slots' windows
    and states as it does, and leave the other slots alone."""
    L = _layer(7, dk=dk, dv=dv)
    g, b_rows = L["gen"], 3
    qkv = torch.randn(b_rows, L["conv_dim"], generator=g).to(DTYPE).to(DEVICE)
    a = torch.randn(b_rows, L["hv"], generator=g).to(DTYPE).to(DEVICE)
    b = torch.randn(b_rows, L["hv"], generator=g).to(DTYPE).to(DEVICE)
    slots = torch.tensor([4, 1, 3], device=DEVICE)
    fresh = torch.tensor(fresh_rows, device=DEVICE) if fresh_rows is not None else None
    conv_ref, out_ref, conv_after, rec_after = _torch_step(L, qkv, a, b, slots, fresh)

    conv, rec = L["conv"].clone(), L["rec"].clone()
    assert gated_delta.decode_ok(qkv, conv, L["weight"], rec, L["dk"], L["dv"])
    x = gated_delta.conv_step(qkv, conv, L["weight"], slots, fresh)
    close_in_dtype(x, conv_ref)
    assert torch.equal(conv, conv_after)  # the windows move by exactly the inputs (no arithmetic)
    out = gated_delta.delta_step(conv_ref, a, b, L["a_log"], L["dt_bias"], rec, slots, fresh, L["hk"], L["dk"],
                                 L["dv"])
    close_in_dtype(out, out_ref)
    torch.testing.assert_close(rec, rec_after, rtol=1e-4, atol=1e-5)
    untouched = [0, 2, 5]
    assert torch.equal(rec[untouched], L["rec"][untouched]) and torch.equal(conv[untouched], L["conv"][untouched])


def test_fresh_sequence_ignores_what_its_slot_held():
    """A sequence at position 0 gives the same output whatever its slot held before."""
    L = _layer(11)
    g = L["gen"]
    qkv = torch.randn(1, L["conv_dim"], generator=g).to(DTYPE).to(DEVICE)
    a, b = (torch.randn(1, L["hv"], generator=g).to(DTYPE).to(DEVICE) for _ in range(2))
    slots, fresh = torch.tensor([2], device=DEVICE), torch.tensor([True], device=DEVICE)
    outs = []
    for fill in (0.0, 5.0):
        conv, rec = L["conv"].clone().fill_(fill), L["rec"].clone().fill_(fill)
        x = gated_delta.conv_step(qkv, conv, L["weight"], slots, fresh)
        outs.append(gated_delta.delta_step(x, a, b, L["a_log"], L["dt_bias"], rec, slots, fresh, L["hk"], L["dk"],
                                           L["dv"]))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows,d", [(4, 128), (3, 96)])
def test_gated_norm_equals_the_torch_chain(rows, d):
    g = torch.Generator().manual_seed(rows * d)
    norm = GatedRMSNorm(d, 1e-6).to(DTYPE).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g) * 0.2 + 1)
    x = (torch.randn(rows, d, generator=g) * 3).to(DTYPE).to(DEVICE)
    z = torch.randn(rows, d, generator=g).to(DTYPE).to(DEVICE)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = ((norm.weight * h.to(DTYPE)) * F.silu(z.float())).to(DTYPE)
    close_in_dtype(gated_delta.gated_rms_norm(x, z, norm.weight, 1e-6), ref)


@pytest.mark.parametrize("add", [False, True])
def test_zero_centered_norm_equals_the_torch_chain(add):
    g = torch.Generator().manual_seed(5)
    d = 2048
    weight = (torch.randn(d, generator=g) * 0.1).to(DTYPE).to(DEVICE)
    x = (torch.randn(3, d, generator=g) * 2).to(DTYPE).to(DEVICE)
    delta = torch.randn(3, d, generator=g).to(DTYPE).to(DEVICE)
    total = x + delta if add else x
    h = total.float() * torch.rsqrt(total.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (h * (1.0 + weight.float())).to(DTYPE)
    got = gated_delta.zero_centered_rms_norm(x, weight, 1e-6, delta if add else None)
    if add:
        assert torch.equal(got[0], total)
        got = got[1]
    close_in_dtype(got, ref)


def test_the_modules_take_the_fused_kernels_with_the_torch_chains_results():
    """GatedRMSNorm and ZeroCenteredRMSNorm run the fused kernels here and agree with their torch chains."""
    from strata.kernels import options

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=g).to(DTYPE).to(DEVICE)
    z = torch.randn(2, 64, generator=g).to(DTYPE).to(DEVICE)
    gated, zero = GatedRMSNorm(64, 1e-6).to(DTYPE).to(DEVICE), ZeroCenteredRMSNorm(64, 1e-6).to(DTYPE).to(DEVICE)
    fused_out = (gated(x, z), zero(x), zero.add_forward(x, z))
    with options.kernel_options(options.KernelOptions(fused=False)):
        torch_out = (gated(x, z), zero(x), zero.add_forward(x, z))
    close_in_dtype(fused_out[0], torch_out[0])
    close_in_dtype(fused_out[1], torch_out[1])
    assert torch.equal(fused_out[2][0], torch_out[2][0])
    close_in_dtype(fused_out[2][1], torch_out[2][1])


def test_fused_kernels_off_turns_these_kernels_off():
    """`[debug] fused_kernels = false`: these kernels step aside for their torch chains with the other fused kernels,
    and come back outside that forward pass."""
    from strata.config import load_config
    from strata.kernels import options
    from strata.runtime.plan.loaded import kernel_options_of

    L = _layer(2)
    x, w = torch.zeros(2, 64, dtype=DTYPE, device=DEVICE), torch.ones(64, dtype=DTYPE, device=DEVICE)
    qkv = torch.zeros(1, L["conv_dim"], dtype=DTYPE, device=DEVICE)
    off = kernel_options_of(load_config({"debug": {"fused_kernels": False}}))
    assert not off.fused
    with options.kernel_options(off):
        assert gated_delta.gated_rms_norm(x, x, w, 1e-6) is None
        assert gated_delta.zero_centered_rms_norm(x, w, 1e-6) is None
        assert not gated_delta.decode_ok(qkv, L["conv"], L["weight"], L["rec"], L["dk"], L["dv"])
    assert gated_delta.zero_centered_rms_norm(x, w, 1e-6) is not None
    assert gated_delta.decode_ok(qkv, L["conv"], L["weight"], L["rec"], L["dk"], L["dv"])

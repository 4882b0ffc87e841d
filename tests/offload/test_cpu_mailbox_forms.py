"""The mailbox worker (csrc/cpu_mailbox.cpp) on experts whose SwiGLU is not the plain one: each served layer's form
and gate_up bias table (strata.runtime.offload.mailbox.CpuMailbox's `form`, `gate_up_bias`), computed by the same
kernel call as the host path's (`cpu_experts_forward` with that form and table: the same bits), split experts' rows
included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm, expert_swiglu, group_by_expert

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

H, INTER, E, K = 64, 32, 8, 2
GPT_OSS = SwiGLUForm(limit=7.0, alpha=1.702, up_offset=1.0, interleaved=True)
DSV4 = SwiGLUForm(limit=10.0)


def _slots(seed: int = 0):
    """E bf16 experts packed as slots (gate_up [2I, H] then down [H, I]), the address table of 3 layers."""
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * INTER, H, generator=g) / 8).to(torch.bfloat16)
    dn = (torch.randn(E, H, INTER, generator=g) / 8).to(torch.bfloat16)
    gu_bytes = 2 * INTER * H * 2
    slab = torch.cat([gu.reshape(E, -1).view(torch.uint8), dn.reshape(E, -1).view(torch.uint8)], dim=1).contiguous()
    addr = np.array([[slab[e].data_ptr() for e in range(E)] for _ in range(3)], dtype=np.int64)
    return gu, dn, slab, addr, gu_bytes


def _mailbox(addr, gu_bytes, **forms):
    from strata.runtime.offload.mailbox import CpuMailbox

    return CpuMailbox([0, 2], addr, hidden=H, inter=INTER, gu_bytes=gu_bytes, payload=gu_bytes * 3 // 2, top_k=K,
                      max_tokens=4, threads=2, device=torch.device("cpu"), **forms)


@needs_kernel
def test_worker_computes_each_layers_form_and_bias_as_the_host_path_does():
    gu, dn, slab, addr, gu_bytes = _slots()
    g = torch.Generator().manual_seed(1)
    table = (2 * torch.randn(E, 2 * INTER, generator=g)).to(torch.bfloat16)  # converted to fp32 once by the mailbox
    forms = {0: GPT_OSS, 2: DSV4}
    box = _mailbox(addr, gu_bytes, form=forms, gate_up_bias={0: table})
    try:
        for step in range(2):
            n = 2 + step
            x = 40 * torch.randn(n, H, generator=g)  # gate_up's outputs of ~9: the clamps bite
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
            w = torch.rand(n, K, generator=g)
            slots = torch.where(ids.reshape(-1) % 2 == 0, -1, 5).to(torch.int32)  # even experts cold
            box.begin_step()
            for layer in (0, 2):
                out = box.exchange(layer, ids.reshape(-1), slots, x, w)
                cold = [(e, sel) for e, sel in group_by_expert(ids, E) if e % 2 == 0]
                bias = table if layer == 0 else None
                want = torch.zeros(n, H)
                ce.cpu_experts_forward(x, [(gu[e], dn[e]) for e, _ in cold], [sel // K for _, sel in cold],
                                       [w.reshape(-1)[sel] for _, sel in cold], out=want, threads=2,
                                       form=forms[layer], gate_up_bias=bias, expert_ids=[e for e, _ in cold])
                assert torch.equal(out, want), layer
                ref = torch.zeros(n, H)
                for e, sel in cold:
                    b = None if bias is None else bias[e].float()
                    y = expert_swiglu(x[sel // K], gu[e].float(), dn[e].float(), forms[layer], b)
                    ref.index_add_(0, sel // K, y * w.reshape(-1)[sel, None])
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                assert err <= ce.tolerance(ce.backend()), (layer, err)
                plain = torch.zeros(n, H)  # the layer's form matters: the plain SwiGLU is far off
                ce.cpu_experts_forward(x, [(gu[e], dn[e]) for e, _ in cold], [sel // K for _, sel in cold],
                                       [w.reshape(-1)[sel] for _, sel in cold], out=plain, threads=2)
                assert ((plain - ref).abs().max() / ref.abs().max()).item() > 0.1
    finally:
        box.close()


@needs_kernel
@pytest.mark.parametrize("cut", [8, 19])
def test_worker_computes_a_split_experts_first_rows_of_the_gpt_oss_form(cut):
    """A cold pair's rows < I: the worker computes its expert's first `cut` intermediate rows, interleaved gate_up rows
    [0, 2 cut) and their biases; the rest added apart makes the whole expert."""
    gu, dn, slab, addr, gu_bytes = _slots(seed=5)
    g = torch.Generator().manual_seed(7)
    table = 2 * torch.randn(E, 2 * INTER, generator=g)
    box = _mailbox(addr, gu_bytes, form=GPT_OSS, gate_up_bias={0: table, 2: table})
    try:
        x = 40 * torch.randn(2, H, generator=g)
        ids = torch.tensor([[3, 5], [3, 6]])
        w = torch.rand(2, K, generator=g)
        slots = torch.tensor([-1, 4, -1, -1], dtype=torch.int32)  # expert 3 (both tokens) and 6 cold, 5 resident
        rows = torch.tensor([cut, INTER, cut, INTER], dtype=torch.int32)  # expert 3 split at `cut`, 6 whole
        box.begin_step()
        out = box.exchange(0, ids.reshape(-1), slots, x, w, rows=rows)

        def part(e, lo, hi):  # intermediate rows [lo, hi) of expert e on x, fp32: [N, H]
            r = slice(2 * lo, 2 * hi)  # interleaved: gate_up rows 2j, 2j + 1
            h = GPT_OSS.apply(x @ gu[e][r].float().T + table[e][r])
            return h @ dn[e][:, lo:hi].float().T

        six = torch.stack([torch.zeros(H), w[1, 1] * part(6, 0, INTER)[1]])
        want = w[:, :1] * part(3, 0, cut) + six
        assert ((out - want).abs().max() / want.abs().max()).item() <= ce.tolerance(ce.backend())
        whole = w[:, :1] * part(3, 0, INTER) + six
        rest = out + w[:, :1] * part(3, cut, INTER)
        assert ((rest - whole).abs().max() / whole.abs().max()).item() <= ce.tolerance(ce.backend())
    finally:
        box.close()


def test_a_mailbox_needs_a_form_for_every_layer_and_biases_of_its_experts():
    _, _, slab, addr, gu_bytes = _slots()
    with pytest.raises(ValueError, match=r"no SwiGLU form for the mailbox's layers \[2\]"):
        _mailbox(addr, gu_bytes, form={0: PLAIN_SWIGLU})
    with pytest.raises(ValueError, match="7 rows for 8 experts"):
        _mailbox(addr, gu_bytes, form=GPT_OSS, gate_up_bias={2: torch.zeros(E - 1, 2 * INTER)})


@needs_kernel
def test_warm_read_of_interleaved_rows_changes_no_result():
    """Warm-ahead's read of interleaved experts (strata_cpu_warm_form: gate_up rows 2j and 2j + 1 of the leading rows,
    as the worker reads a layer of such a form ahead): the bytes of those rows, and the kernel computing each thread's
    piece first gives the bits of a cold call."""
    import array

    from strata.kernels.cpu.expert_args import bias_rows

    gu, dn, slab, addr, gu_bytes = _slots(seed=2)
    g = torch.Generator().manual_seed(3)
    x, table = 40 * torch.randn(2, H, generator=g), 2 * torch.randn(E, 2 * INTER, generator=g)
    idx, w = torch.tensor([0, 1]), torch.tensor([0.5, 0.25])
    chosen, warm = [1, 4, 6], [INTER, 9, 0]
    meta = array.array("q")
    for e in chosen:
        meta.extend((slab[e].data_ptr(), slab[e].data_ptr() + gu_bytes, idx.data_ptr(), w.data_ptr(), 2, INTER, INTER))
    biases, kept = bias_rows(table, chosen, INTER)
    cold = torch.zeros(2, H)
    assert ce.run_packed(x, meta, cold, threads=2, form=GPT_OSS, gate_up_bias=biases)
    lib = ce.library()
    a, r = array.array("q", [slab[e].data_ptr() for e in chosen]), array.array("q", warm)
    read = lib.strata_cpu_warm_form(a.buffer_info()[0], r.buffer_info()[0], 3, 2 * H, INTER, 1, 2, None, 0, None)
    assert read == 2 * 2 * H * sum(warm)
    got = torch.zeros(2, H)
    assert ce.run_packed(x, meta, got, threads=2, warm=array.array("q", warm), form=GPT_OSS, gate_up_bias=biases)
    assert torch.equal(got, cold)

"""The decode pair kernels compute every `SwiGLUForm` and add a per-expert gate_up bias
(strata.kernels.gpu.experts.pair_forms, plain_pairs, quant_pairs, gguf_pairs), against fp32 torch on the experts'
dequantized weights:

    gu = x gate_up^T + bias[expert]   h = form.apply(gu)   y = h down^T   (a split part: h's rows from first_row on)

Forms: the plain SwiGLU, DeepSeek-V4's (limit 10) and gpt-oss's (limit 7, alpha 1.702, up_offset 1, interleaved
gate/up rows, with a bias); on fp32 and bf16 slots, FP8 and MXFP4 blobs, GGUF blobs (every form but interleaved rows,
which they refuse). Inputs are scaled so that gate and up reach past the limit: each test also checks that the
reference moves far beyond the tolerance when the clamp, the interleaving, alpha / up_offset or the bias is left out,
so a kernel that ignored any of them would fail.

The torch fallback (`_pair_torch`) and the argument checks run on any CPU. The `kernel` tests run the Triton kernels:
natively on CUDA (marked gpu), and on the CPU under Triton's interpreter (tests/kernels/test_kernels_interpreted.py
runs them in a subprocess: TRITON_INTERPRET is read when Triton is imported)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf_blocks_random import random_blocks

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.gpu import fused
from strata.kernels.gpu.experts import gguf_pairs, grouped, quant_pairs
from strata.kernels.gpu.experts.grouped import HostExperts, SlotWeights
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
from strata.kernels.quant import ExpertFormat, ExpertLayout

CUDA = torch.cuda.is_available()
if CUDA:
    KERNEL = [pytest.mark.gpu]
elif fused._INTERPRET and quant_pairs.triton is not None:
    KERNEL = []
else:  # no kernel can run here: the gpu mark skips them
    KERNEL = [pytest.mark.gpu]
DEVICE = "cuda" if CUDA else "cpu"

DEEPSEEK_V4 = SwiGLUForm(limit=10.0)
GPT_OSS = SwiGLUForm(limit=7.0, alpha=1.702, up_offset=1.0, interleaved=True)
GPT_OSS_GGUF = replace(GPT_OSS, interleaved=False)  # gate rows first, as a GGUF blob holds them
FORMS = {"plain": (PLAIN_SWIGLU, False), "deepseek-v4": (DEEPSEEK_V4, False), "gpt-oss": (GPT_OSS, True)}
# (format, hidden, intermediate); the "bf16" kind's activations are bf16, the others' fp32 (the interpreter rounds
# to bf16 by truncation, but nothing here rounds to bf16: the kernels load bf16 and work in fp32)
KINDS = {"fp32": (ExpertFormat("plain", "F32"), 64, 32), "bf16": (ExpertFormat("plain", "BF16"), 64, 32),
         "fp8": (ExpertFormat("fp8", block=(16, 16)), 64, 32), "mxfp4": (ExpertFormat("mxfp4"), 64, 32)}
GGUF = (ExpertFormat("gguf", ggml=(("Q8_0",),) * 3), 96, 64)
GGUF_PAIRS = ((64, 128, 4, 1), (128, 64, 4, 1))  # the interpreter's gguf launches: whole tiny matrices a program
GGUF_IN_PLACE = (64, 128, 128, 64)
SLOT_OF = [2, -1, 0, 3, 1, -1]  # expert -> slot; experts 1 and 5 not resident
E, GU_STD = len(SLOT_OF), 8.0  # gate and up of about N(0, 8^2): past limits 7 and 10 often, not always


def _experts(fmt: ExpertFormat, h: int, i: int, seed: int, device: str = "cpu"):
    """Four slots holding experts 0, 2, 3, 4 of six in `fmt`, slots 4 KiB aligned. Returns (what the pair kernels
    take: SlotWeights or QuantSlotWeights, the dequantized fp32 SlotWeights, the uint8 slab, the layout)."""
    g = torch.Generator().manual_seed(seed)
    layout = ExpertLayout.build(fmt, h, i)
    slab = torch.zeros(4, -(-layout.payload_bytes // 4096) * 4096, dtype=torch.uint8)
    rng = np.random.default_rng(seed)
    for s in range(4):
        if fmt.kind == "gguf":
            t = fmt.ggml[0][0]
            mats = [(t, torch.from_numpy(random_blocks(t, r, k, rng, amax=0.2))) for r, k in ((i, h), (i, h), (h, i))]
            layout.pack_gguf(*mats, out=slab[s])
        else:
            layout.pack(torch.randn(2 * i, h, generator=g) / h**0.5, torch.randn(h, i, generator=g) / i**0.5,
                        out=slab[s])
    mats = [layout.dequantize(slab[s], torch.float32) for s in range(4)]
    oracle = SlotWeights(torch.stack([m[0] for m in mats]).to(device), torch.stack([m[1] for m in mats]).to(device))
    slab = slab.to(device)
    return grouped.slot_weights(slab, layout), oracle, slab, layout


def _inputs(oracle: SlotWeights, n: int, seed: int, dtype: torch.dtype, bias: bool):
    """x [n, H] of `dtype` scaled so gate_up x has a standard deviation of GU_STD, and a bias [E, 2I] (bf16) or None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, oracle.gate_up.shape[2], generator=g).to(oracle.gate_up.device)
    x = (x * GU_STD / (oracle.gate_up @ x.T).std()).to(dtype)
    b = (torch.randn(E, oracle.gate_up.shape[1], generator=g) * 2).to(oracle.gate_up.device, torch.bfloat16)
    return x, (b if bias else None)


def _want(x, oracle: SlotWeights, ids, k, form: SwiGLUForm, bias, first=None):
    """fp32 torch, pair by pair: (y [P, H] (zeros for pairs not resident), the resident pairs' gu [P', 2I])."""
    y = torch.zeros(ids.numel(), oracle.gate_up.shape[2], device=x.device)
    gus = []
    for p, e in enumerate(ids.tolist()):
        s = SLOT_OF[e]
        if s < 0:
            continue
        gu = oracle.gate_up[s] @ x[p // k].float()  # [2I]
        gu = gu if bias is None else gu + bias[e].float()
        f = 0 if first is None else int(first[p])
        y[p] = oracle.down[s][:, f:] @ form.apply(gu)[f:]
        gus.append(gu)
    return y, torch.stack(gus)


def _check(got, x, oracle, ids, k, form, bias, ok, first=None) -> None:
    """got's resident rows `ok` equal the reference to fp32 rounding, and the reference is sensitive to each part of
    the form: the clamp bites (gate above the limit, up beyond +-limit), and leaving out the clamp, the interleaving,
    alpha / up_offset or the bias moves it by far more than the tolerance."""
    want, gus = _want(x, oracle, ids, k, form, bias, first)
    tol = 1e-4 * want[ok].abs().max().item()
    assert tol > 1e-4  # outputs well away from zero: the tolerance means something
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-4, atol=tol)
    if form.limit is not None:
        gate, up = (gus[:, 0::2], gus[:, 1::2]) if form.interleaved else gus.chunk(2, dim=-1)
        assert (gate > form.limit).any() and (up > form.limit).any() and (up < -form.limit).any()
    others = {"clamp": (replace(form, limit=None), bias) if form.limit is not None else None,
              "interleaving": (replace(form, interleaved=False), bias) if form.interleaved else None,
              "alpha/up_offset": (replace(form, alpha=1.0, up_offset=0.0), bias) if form.alpha != 1.0 else None,
              "bias": (form, None) if bias is not None else None}
    for what, other in others.items():
        if other is not None:
            assert (_want(x, oracle, ids, k, *other, first)[0][ok] - want[ok]).abs().max() > 100 * tol, what


def _ids(n: int, k: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]).reshape(-1).to(device)


# ---- the torch fallback and the argument checks (any CPU) ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["fp32", "fp8", "mxfp4"])
@pytest.mark.parametrize("name", list(FORMS))
def test_the_torch_fallback_computes_every_form_and_bias(kind, name):
    """`pair_experts` on CPU tensors (`_pair_torch`): each form, the bias row ids[p], skipped pairs' rows kept."""
    form, bias = FORMS[name]
    weights, oracle, _, _ = _experts(*KINDS[kind], seed=1)
    x, b = _inputs(oracle, 3, seed=2, dtype=torch.float32, bias=bias)
    ids = _ids(3, 2, seed=3, device="cpu")
    y = torch.full((6, x.shape[1]), 7.0)
    used = grouped.pair_experts(x, weights, torch.tensor(SLOT_OF, dtype=torch.int32), ids, y, form=form,
                                gate_up_bias=b)
    ok = used >= 0
    assert (~ok).any() and torch.all(y[~ok] == 7.0)
    _check(y, x, oracle, ids, 2, form, b, ok)


def test_the_plain_form_is_the_default_bit_for_bit():
    weights, oracle, _, _ = _experts(*KINDS["fp32"], seed=4)
    x, _ = _inputs(oracle, 2, seed=5, dtype=torch.float32, bias=False)
    ids, slot_of = _ids(2, 2, seed=6, device="cpu"), torch.tensor(SLOT_OF, dtype=torch.int32)
    a, b = torch.zeros(4, x.shape[1]), torch.zeros(4, x.shape[1])
    grouped.pair_experts(x, weights, slot_of, ids, a)
    grouped.pair_experts(x, weights, slot_of, ids, b, form=SwiGLUForm())
    assert torch.equal(a, b)


def test_bad_biases_and_forms_are_refused():
    weights, oracle, slab, layout = _experts(*KINDS["fp8"], seed=7)
    x, y, ids = torch.zeros(1, 64), torch.zeros(2, 64), torch.tensor([0, 2])
    slot_of = torch.tensor(SLOT_OF, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gate_up_bias must be \[E, 64\]"):
        grouped.pair_experts(x, weights, slot_of, ids, y, gate_up_bias=torch.zeros(E, 32))
    with pytest.raises(ValueError, match="floating point"):
        grouped.pair_experts(x, weights, slot_of, ids, y, gate_up_bias=torch.zeros(E, 64, dtype=torch.int32))
    addr = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs expert_ids"):
        grouped.pair_experts_in_place(x, HostExperts.of_layout(layout), addr, y, gate_up_bias=torch.zeros(E, 64))
    gguf, _, _, _ = _experts(*GGUF, seed=8)
    with pytest.raises(ValueError, match="no interleaved"):
        quant_pairs.pair_quant(torch.zeros(1, 96), gguf, slot_of, ids, None, 2, torch.zeros(2, 96),
                               torch.zeros(2, dtype=torch.int32), form=GPT_OSS)
    with pytest.raises(ValueError, match="no interleaved"):
        quant_pairs.pair_quant_in_place(torch.zeros(1, 96), gguf.layout, addr, torch.zeros(2, 96), form=GPT_OSS)


# ---- the Triton kernels (CUDA; or the CPU under TRITON_INTERPRET=1) -------------------------------------------------

def _run_pairs(x, weights, slot_of, ids, y, form, bias, config=None) -> torch.Tensor:
    """The pair kernels as the decode step runs them: `pair_experts` on CUDA; its Triton paths directly under the
    interpreter (pair_experts takes the torch path on CPU tensors)."""
    if CUDA:
        return grouped.pair_experts(x, weights, slot_of, ids, y, form=form, gate_up_bias=bias)
    used = torch.empty(ids.numel(), dtype=torch.int32)
    k = y.shape[0] // x.shape[0]
    if isinstance(weights, QuantSlotWeights):
        quant_pairs.pair_quant(x, weights, slot_of, ids, None, k, y, used, config, form=form, gate_up_bias=bias)
    else:
        grouped._pair_triton(x, weights, slot_of, ids, None, k, y, used, form, bias)
    return used


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(FORMS))
def test_kernel_pairs_compute_every_form(kind, name):
    """Resident pairs (slot lookup in the kernel) on fp32, bf16, FP8 and MXFP4 slots: each form and the bias, to
    fp32 rounding of the reference; pairs not resident skipped, their rows untouched."""
    form, bias = FORMS[name]
    fmt, h, i = KINDS[kind]
    weights, oracle, _, _ = _experts(fmt, h, i, seed=10, device=DEVICE)
    x, b = _inputs(oracle, 3, seed=11, dtype=torch.bfloat16 if kind == "bf16" else torch.float32, bias=bias)
    ids = _ids(3, 2, seed=12, device=DEVICE)
    y = torch.full((6, h), 7.0, device=DEVICE)
    used = _run_pairs(x, weights, torch.tensor(SLOT_OF, dtype=torch.int32, device=DEVICE), ids, y, form, b)
    ok = used >= 0
    assert torch.equal(used.cpu(), torch.tensor(SLOT_OF, dtype=torch.int32)[ids.cpu()])
    assert (~ok).any() and torch.all(y[~ok] == 7.0)
    _check(y, x, oracle, ids, 2, form, b, ok)


@pytest.mark.parametrize("form", [DEEPSEEK_V4, GPT_OSS_GGUF], ids=["deepseek-v4", "gpt-oss-gate-first"])
def test_kernel_gguf_pairs_compute_clamped_scaled_forms_and_bias(form):
    weights, oracle, _, _ = _experts(*GGUF, seed=13, device=DEVICE)
    bias = form.up_offset != 0.0
    x, b = _inputs(oracle, 3, seed=14, dtype=torch.float32, bias=bias)
    ids = _ids(3, 2, seed=15, device=DEVICE)
    y = torch.full((6, GGUF[1]), 7.0, device=DEVICE)
    used = _run_pairs(x, weights, torch.tensor(SLOT_OF, dtype=torch.int32, device=DEVICE), ids, y, form, b,
                      config=None if CUDA else GGUF_PAIRS)
    ok = used >= 0
    assert torch.all(y[~ok] == 7.0)
    _check(y, x, oracle, ids, 2, form, b, ok)


def _addresses(slab: torch.Tensor):
    """The slots where the in-place kernels read them: page-locked host memory on CUDA (the store's pinned slots),
    the slab itself under the interpreter. Returns (address of slot s, a closer)."""
    if not CUDA:
        return (lambda s: slab[s].data_ptr()), (lambda: None)
    from strata.tiers.storage.pinned import PinnedPool

    pool = PinnedPool(slab.shape[1], slab.shape[0], background=False)
    for s in range(slab.shape[0]):
        pool.slot(s).copy_(slab[s].cpu())
    return pool.slot_address, pool.close


def _in_place(kind_or_gguf, name, form, bias, monkeypatch) -> None:
    """Six pairs read in place (the fifth not in this pass), whole and split: first_row [0, 5, I/2, I - 1, 0, I]."""
    fmt, h, i = GGUF if kind_or_gguf == "gguf" else KINDS[kind_or_gguf]
    if kind_or_gguf == "gguf" and not CUDA:
        monkeypatch.setattr(gguf_pairs, "GGUF_IN_PLACE_BLOCKS", GGUF_IN_PLACE)
    _, oracle, slab, layout = _experts(fmt, h, i, seed=16, device=DEVICE)
    x, b = _inputs(oracle, 3, seed=17, dtype=torch.bfloat16 if kind_or_gguf == "bf16" else torch.float32, bias=bias)
    b = None if b is None else b.float()  # (the pairs' tests read a bf16 bias)
    ids = torch.tensor([0, 2, 3, 4, 0, 3], device=DEVICE)  # resident experts only
    address, close = _addresses(slab)
    try:
        addr = torch.tensor([address(SLOT_OF[e]) for e in ids.tolist()], dtype=torch.int64)
        addr[4] = 0  # not in this pass
        addr = addr.to(DEVICE)
        experts = HostExperts.of_layout(layout)
        keep = torch.tensor([True, True, True, True, False, True], device=DEVICE)
        eids = ids.to(torch.int32)
        for first in (None, torch.tensor([0, 5, i // 2, i - 1, 0, i], dtype=torch.int32, device=DEVICE)):
            y = torch.full((6, h), 7.0, device=DEVICE)
            grouped.pair_experts_in_place(x, experts, addr, y, first_row=first, form=form, gate_up_bias=b,
                                          expert_ids=eids if b is not None else None)
            assert torch.all(y[4] == 7.0)
            if first is not None:
                assert torch.all(y[5] == 0.0)  # first_row I: no rows of its own
            _check(y, x, oracle, ids, 2, form, b, keep, first)
    finally:
        if CUDA:
            torch.cuda.synchronize()
        close()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", ["deepseek-v4", "gpt-oss"])
def test_kernel_in_place_reads_compute_every_form_whole_and_split(monkeypatch, kind, name):
    """`pair_experts_in_place` (weights read by host address) on fp32, bf16, FP8 and MXFP4 slots with each non-plain
    form; the bias row from expert_ids; a split expert's GPU part (first_row) is the sum over its intermediate rows
    from first_row on, interleaved rows 2j and 2j + 1 with gpt-oss's form."""
    _in_place(kind, name, *FORMS[name], monkeypatch)


@pytest.mark.parametrize("form", [DEEPSEEK_V4, GPT_OSS_GGUF], ids=["deepseek-v4", "gpt-oss-gate-first"])
def test_kernel_in_place_gguf_reads_compute_clamped_scaled_forms(monkeypatch, form):
    _in_place("gguf", "", form, form.up_offset != 0.0, monkeypatch)


for _name in [n for n in list(globals()) if n.startswith("test_kernel_")]:
    for _mark in KERNEL:
        globals()[_name] = _mark(globals()[_name])

"""The CPU expert kernel on every SwiGLU form (strata.kernels.experts.SwiGLUForm, csrc/cpu_experts_act.h): plain,
DeepSeek-V4's clip (limit 10) and gpt-oss's clamped, scaled, offset SwiGLU on interleaved gate/up rows with a per-expert
gate_up bias, on bf16, FP8, MXFP4 and GGUF experts, against the fp32 reference on the dequantized weights
(gu = x gate_up^T + bias, h = form.apply(gu), y = h down^T: `strata.kernels.experts.expert_swiglu`). Activations are scaled so that
the clamp changes the result by far more than any backend's tolerance (a kernel ignoring it fails); each AVX-512
backend stays bit-identical to its emulation; split experts, warm rows, the launcher thread and prompt-sized experts
take the form too."""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch

from strata.kernels.cpu import experts as ce
from strata.kernels.cpu.expert_args import bias_rows, slot_pointers
from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm, expert_swiglu
from strata.kernels.quant import ExpertFormat, ExpertLayout

needs_kernel = pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")

DSV4 = SwiGLUForm(limit=10.0)
GPT_OSS = SwiGLUForm(limit=7.0, alpha=1.702, up_offset=1.0, interleaved=True)
FORMS = {"plain": (PLAIN_SWIGLU, False), "deepseek_v4": (DSV4, False), "gpt_oss": (GPT_OSS, True)}
FMT = {"bf16": None, "fp8": ExpertFormat("fp8", block=(16, 32)), "mxfp4": ExpertFormat("mxfp4"),
       "q4_k": ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q4_K",))),
       "gguf_mixed": ExpertFormat("gguf", ggml=(("Q4_K",), ("Q8_0",), ("Q6_K",)))}
SHAPE = {"bf16": (200, 77), "fp8": (160, 96), "mxfp4": (288, 96), "q4_k": (256, 256), "gguf_mixed": (256, 256)}
EMULATED = {"avx512": "avx512_emulated", "avx512_bf16": "avx512_bf16_emulated"}
E, TABLE_ROWS = 3, 6  # experts a call; rows of the layer's bias table (the call's experts are rows IDS of it)
IDS = [4, 0, 2]


def backends() -> list[str]:
    """What runs here, plus the AVX-512 kernels' emulations wherever the extension loads."""
    names = ce.available_backends()
    return names + (list(EMULATED.values()) if len(names) > 1 else [])


def experts(kind: str, seed: int = 0):
    """E experts of format `kind`: (layout or None, blobs, weights as the kernel takes them, fp32 pairs)."""
    H, inter = SHAPE[kind]
    fmt = FMT[kind]
    g = torch.Generator().manual_seed(seed)
    if fmt is None:  # bf16: each expert one blob [gate_up | down], as a store slot
        blobs = [(torch.randn(3 * inter * H, generator=g) / H**0.5).to(torch.bfloat16) for _ in range(E)]
        mats = [(b[: 2 * inter * H].view(2 * inter, H), b[2 * inter * H:].view(H, inter)) for b in blobs]
        return None, blobs, mats, [(gu.float(), dn.float()) for gu, dn in mats]
    layout = ExpertLayout.build(fmt, H, inter)
    if fmt.kind == "gguf":
        from gguf_blocks_random import random_blocks

        pytest.importorskip("gguf")
        rng = np.random.default_rng(seed)
        (tg,), (tu,), (td,) = fmt.ggml
        blobs = [layout.pack_gguf((tg, torch.from_numpy(random_blocks(tg, inter, H, rng))),
                                  (tu, torch.from_numpy(random_blocks(tu, inter, H, rng))),
                                  (td, torch.from_numpy(random_blocks(td, H, inter, rng)))) for _ in range(E)]
    else:
        blobs = [layout.pack(torch.randn(2 * inter, H, generator=g) / H**0.5,
                             torch.randn(H, inter, generator=g) / inter**0.5) for _ in range(E)]
    return layout, blobs, [layout.matrices(b) for b in blobs], [layout.dequantize(b, torch.float32) for b in blobs]


def inputs(deq, N: int, seed: int = 0):
    """x [N, H] scaled so that gate's and up's outputs have standard deviations of at least about 9 (the clamps at 7
    and 10 bite), the routing (every expert some tokens) and the layer's bias table [TABLE_ROWS, 2I] (standard
    deviation 2)."""
    g = torch.Generator().manual_seed(100 + seed)
    H, inter = deq[0][1].shape
    x = torch.randn(N, H, generator=g)
    x *= 9.0 / min(torch.cat([x @ gu[rows].T for gu, _ in deq]).std() for rows in (slice(0, inter), slice(inter, None)))
    idx = [torch.randperm(N, generator=g)[: max(1, (N * (e + 2)) // (E + 1))].sort().values for e in range(E)]
    tw = [torch.rand(i.numel(), generator=g) for i in idx]
    return x, idx, tw, 2.0 * torch.randn(TABLE_ROWS, 2 * inter, generator=g)


def reference(x, deq, idx, tw, form, table, rows=None):
    """sum over experts of tw * expert_swiglu(x[idx]) on the fp32 weights, experts in order; rows[e]: of expert e only
    its first rows intermediate rows (a split expert's CPU part: gate_up's rows of them, down's columns)."""
    out = torch.zeros(x.shape)
    for e, ((gu, dn), i, w) in enumerate(zip(deq, idx, tw, strict=True)):
        b = None if table is None else table[IDS[e]]
        if rows is not None and rows[e] < dn.shape[1]:
            r, inter = rows[e], dn.shape[1]
            keep = torch.cat([torch.arange(2 * r)] if form.interleaved else [torch.arange(r), inter + torch.arange(r)])
            gu, dn, b = gu[keep], dn[:, :r], None if b is None else b[keep]
        out.index_add_(0, i, expert_swiglu(x[i], gu, dn, form, b) * w[:, None])
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def kind_of(kind: str) -> str:
    return "plain" if FMT[kind] is None else FMT[kind].kind


@pytest.mark.parametrize("form_name", list(FORMS))
@pytest.mark.parametrize("kind", list(FMT))
@pytest.mark.parametrize("N", [1, 3, 8])
def test_every_form_matches_the_reference_on_every_backend(kind, form_name, N):
    form, with_bias = FORMS[form_name]
    _, _, mats, deq = experts(kind, seed=N)
    x, idx, tw, table = inputs(deq, N, seed=N)
    table = table if with_bias else None
    ref = reference(x, deq, idx, tw, form, table)
    names = backends()
    if form.limit is not None:  # the clamp bites: ignoring it would miss by far more than any tolerance
        gu = torch.cat([x[i] @ g.T + (0 if table is None else table[IDS[e]]) for e, ((g, _), i) in
                        enumerate(zip(deq, idx, strict=True))])
        gate, up = (gu[:, 0::2], gu[:, 1::2]) if form.interleaved else gu.chunk(2, dim=-1)
        assert (gate > form.limit).float().mean() > 0.02 and (up.abs() > form.limit).float().mean() > 0.02
        unclamped = reference(x, deq, idx, tw, SwiGLUForm(None, form.alpha, form.up_offset, form.interleaved), table)
        assert rel_err(unclamped, ref) > 2 * max(ce.tolerance(n, kind_of(kind)) for n in names)
    outs = {}
    for name in names:
        outs[name] = ce.cpu_experts_forward(x, mats, idx, tw, threads=2, backend=name, form=form, gate_up_bias=table,
                                            expert_ids=IDS if table is not None else None)
        assert rel_err(outs[name], ref) <= ce.tolerance(name, kind_of(kind)), (name, rel_err(outs[name], ref))
    for real, emu in EMULATED.items():
        if real in outs and emu in outs and ce.backend(real, FMT[kind] or "plain") == real:
            assert torch.equal(outs[real], outs[emu]), (real, rel_err(outs[real], outs[emu]))
    assert torch.equal(outs["torch"], ref)  # the torch path is the reference math


def _packed(layout, blobs, mats, rows, idx, w, inter):
    """run_packed's arguments for the experts at their addresses, each expert's first rows[e] intermediate rows."""
    meta, scales = array.array("q"), array.array("q")
    for e in range(E):
        if layout is None:
            gu, dn, gus, dns = mats[e][0].data_ptr(), mats[e][1].data_ptr(), 0, 0
        else:
            gu, dn, gus, dns = slot_pointers(layout, blobs[e].data_ptr())
        meta.extend((gu, dn, idx[e].data_ptr(), w[e].data_ptr(), idx[e].numel(), rows[e], inter))
        scales.extend((gus, dns))
    return meta, scales


@needs_kernel
@pytest.mark.parametrize("kind", list(FMT))
def test_split_experts_compute_their_leading_rows_of_the_gpt_oss_form(kind):
    """A split expert's CPU part, the first r of I intermediate rows: with interleaved rows that is gate_up's first 2r
    rows and their biases, down's first r columns (r not a multiple of MXFP4's groups nor of GGUF's blocks)."""
    layout, blobs, mats, deq = experts(kind, seed=11)
    H, inter = SHAPE[kind]
    x, idx, tw, table = inputs(deq, 4, seed=3)
    idx = [i.to(torch.int64).contiguous() for i in idx]
    rows = [inter, inter - 45, 19]
    ref = reference(x, deq, idx, tw, GPT_OSS, table, rows)
    meta, scales = _packed(layout, blobs, mats, rows, idx, tw, inter)
    biases, kept = bias_rows(table, IDS, inter)
    fmt = None if layout is None else layout.fmt
    outs = {}
    for name in [b for b in backends() if b != "torch" and ce.backend(b, fmt or "plain") == b]:
        outs[name] = torch.zeros(x.shape)
        assert ce.run_packed(x, meta, outs[name], threads=2, backend=name, fmt=fmt,
                             scales=scales if fmt is not None else None, form=GPT_OSS, gate_up_bias=biases)
        assert rel_err(outs[name], ref) <= ce.tolerance(name, kind_of(kind)), (name, rel_err(outs[name], ref))
    assert outs, "no backend reads these experts"
    for real, emu in EMULATED.items():
        if real in outs and emu in outs:
            assert torch.equal(outs[real], outs[emu]), real


@needs_kernel
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_warm_rows_and_the_launcher_thread_change_no_bit_of_a_form(kind):
    """The warm rows' pieces computed first (run_packed's warm) and the asynchronous call (start_packed) give the
    gpt-oss form's same bits as a plain run_packed call."""
    layout, blobs, mats, deq = experts(kind, seed=5)
    inter = SHAPE[kind][1]
    x, idx, tw, table = inputs(deq, 3, seed=5)
    idx = [i.to(torch.int64).contiguous() for i in idx]
    meta, scales = _packed(layout, blobs, mats, [inter] * E, idx, tw, inter)
    biases, kept = bias_rows(table, IDS, inter)
    fmt = None if layout is None else layout.fmt
    kw = {"fmt": fmt, "scales": scales if fmt is not None else None, "form": GPT_OSS, "gate_up_bias": biases}
    ref = torch.zeros(x.shape)
    assert ce.run_packed(x, meta, ref, threads=1, **kw)
    assert rel_err(ref, reference(x, deq, idx, tw, GPT_OSS, table)) <= ce.tolerance(ce.backend(kind=fmt or "plain"),
                                                                                  kind_of(kind))
    warm = torch.zeros(x.shape)
    assert ce.run_packed(x, meta, warm, threads=2, warm=array.array("q", [inter, 7, 0]), **kw)
    started = torch.zeros(x.shape)
    call = ce.start_packed(x, meta, started, 2, **kw)
    assert call is not None
    call.wait()
    assert torch.equal(warm, ref) and torch.equal(started, ref)


@needs_kernel
def test_prompt_sized_experts_take_the_form_on_torchs_gemms():
    """A bf16 expert with more tokens than the kernel takes runs as torch's bf16 GEMMs (`bf16_expert`), a quantized
    one on the kernel in groups of tokens: both with the form and bias, within the avx512_bf16 bound."""
    for kind in ("bf16", "mxfp4"):
        _, _, mats, deq = experts(kind, seed=2)
        N = ce.max_tokens(ce.backend(kind=FMT[kind] or "plain")) + 5
        x, idx, tw, table = inputs(deq, N, seed=2)
        out = ce.cpu_experts_forward(x, mats, idx, tw, form=GPT_OSS, gate_up_bias=table, expert_ids=IDS)
        assert rel_err(out, reference(x, deq, idx, tw, GPT_OSS, table)) <= ce.tolerance("avx512_bf16", kind_of(kind))


def test_forms_and_bias_tables_the_kernel_cannot_take_are_refused():
    _, _, mats, deq = experts("bf16")
    x, idx, tw, table = inputs(deq, 2)
    with pytest.raises(ValueError, match="SwiGLU form"):
        ce.cpu_experts_forward(x, mats, idx, tw, form=SwiGLUForm(limit=0.0))
    with pytest.raises(ValueError, match=r"\[E, 2I\]"):
        ce.cpu_experts_forward(x, mats, idx, tw, form=GPT_OSS, gate_up_bias=table[0])
    with pytest.raises(ValueError, match="no row 9"):
        ce.cpu_experts_forward(x, mats, idx, tw, form=GPT_OSS, gate_up_bias=table, expert_ids=[9, 0, 1])
    with pytest.raises(ValueError, match="expert_ids"):
        ce.cpu_experts_forward(x, mats, idx, tw, form=GPT_OSS, gate_up_bias=table, expert_ids=[0])
    with pytest.raises(IndexError):
        bias_rows(table, [TABLE_ROWS], SHAPE["bf16"][1])

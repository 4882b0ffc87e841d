"""The CPU expert kernel on GGUF experts (csrc/cpu_experts_gguf*.h): each matrix read in its own ggml block type as
stored, against the fp32 reference on the weights `gguf` dequantizes (`expert_swiglu` on `ExpertLayout.dequantize`).
Random valid blocks of every type the kernel reads, each backend within `tolerance(backend, "gguf")`, and within
float32 rounding of the same math on bf16-rounded activations (the kernel's own rounding: a wrong code or scale in
one sub-block shows there); avx512_bf16 bit-identical to its emulation; types mixed per matrix and per expert; split
experts; types a backend does not read on the torch path; an engine on a tiny GGUF model through a CPU tier."""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_blocks_random import random_blocks

from strata.kernels import quant
from strata.kernels.cpu import experts as ce
from strata.kernels.cpu.expert_args import GGUF_TYPES, slot_pointers
from strata.kernels.experts import expert_swiglu
from strata.kernels.quant import ExpertFormat, ExpertLayout

pytest.importorskip("gguf")
READ = sorted(GGUF_TYPES["avx512_bf16"])  # every type strata keeps experts in
OWN_ROUNDING = 1e-4  # against the reference on bf16-rounded activations, after `rounded_apart` (Q2_K: 4e-5)


def kernel_backends() -> list[str]:
    """The backends here that read GGUF: avx512_bf16 where the CPU has it, its emulation where the extension loads."""
    have = ce.available_backends()
    return [b for b in ("avx512_bf16", "avx512_bf16_emulated") if b in have or (b.endswith("emulated") and have[1:])]


needs_kernel = pytest.mark.skipif(not kernel_backends(), reason="needs the compiled CPU expert kernel")


def gguf_experts(types: list[tuple[str, str, str]], H: int, inter: int, fmt: ExpertFormat | None = None, seed: int = 0):
    """An expert per (gate, up, down) types, random valid blocks: (layout, blobs, QuantMatrix pairs, fp32 pairs)."""
    fmt = fmt or ExpertFormat("gguf", ggml=tuple(tuple(sorted({t[j] for t in types})) for j in range(3)))
    layout = ExpertLayout.build(fmt, H, inter)
    rng = np.random.default_rng(seed)
    blobs = []
    for g, u, d in types:
        blocks = (random_blocks(g, inter, H, rng), random_blocks(u, inter, H, rng), random_blocks(d, H, inter, rng))
        blobs.append(layout.pack_gguf(*((t, torch.from_numpy(b)) for t, b in zip((g, u, d), blocks, strict=True))))
    return layout, blobs, [layout.matrices(b) for b in blobs], [layout.dequantize(b, torch.float32) for b in blobs]


def routing(N: int, E: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = [torch.randperm(N, generator=g)[: max(1, (N * (e + 2)) // (E + 1))].sort().values for e in range(E)]
    return idx, [torch.rand(i.numel(), generator=g) for i in idx]


def reference(x, deq, idx, tw, bf16: bool = False):
    """fp32 SwiGLU on the dequantized weights; bf16: on x and silu(gate) * up rounded to bf16, as avx512_bf16 reads
    them (then only the order of the fp32 sums differs from the kernel)."""
    out = torch.zeros(x.shape)
    for (gu, dn), i, w in zip(deq, idx, tw, strict=True):
        if not bf16:
            y = expert_swiglu(x[i], gu, dn)
        else:
            xb = x[i].bfloat16().float()
            gate, up = (xb @ gu.T).chunk(2, dim=-1)
            y = (F.silu(gate) * up).bfloat16().float() @ dn.T
        out.index_add_(0, i, y * w[:, None])
    return out


def rel_err(a, ref) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def rounded_apart(x, out, deq, idx, tw) -> float:
    """rel_err of one expert's output against `reference(bf16=True)` once, per token, up to two values of silu(gate) *
    up that the kernel rounded to the other bf16 neighbour are taken out: its gate and up sums, in another order, can
    fall on the other side of a rounding boundary, which moves the output along a column of down by one bf16 step of
    that value (checked: the least-squares steps are no larger). What remains is the order of fp32 sums."""
    ref = reference(x, deq, idx, tw, bf16=True)
    (gu, dn), = deq
    diff = out - ref
    xb = x.bfloat16().float()
    gate, up = (xb @ gu.T).chunk(2, dim=-1)
    h = F.silu(gate) * up  # [N, I]
    for k, t in enumerate(idx[0].tolist()):
        cols, rest = [], diff[t]
        for _ in range(2):
            cols.append(int(((dn.T @ rest) / (dn * dn).sum(0)).abs().argmax()))
            steps = torch.linalg.lstsq(dn[:, cols].double(), diff[t].double()[:, None]).solution[:, 0].float()
            rest = diff[t] - dn[:, cols] @ steps
        bf16_steps = h[t, cols].abs() * 2.0**-7 * tw[0][k]  # one bf16 step of each value, times its routing weight
        if bool((steps.abs() <= 1.5 * bf16_steps).all()):
            diff[t] = rest
    return (diff.abs().max() / ref.abs().max()).item()


CASES = [(t, t, t) for t in READ] + [("Q4_K", "Q2_K", "Q6_K"), ("Q8_0", "Q6_K", "Q4_K"), ("Q5_K", "Q5_K", "Q3_K"),
                                     ("IQ4_XS", "Q3_K", "Q5_K")]


@pytest.mark.parametrize("types", CASES, ids=["-".join(t) for t in CASES])
@pytest.mark.parametrize("N", [1, 3, 7])  # 7: experts of 3, 5 and 7 tokens (a tile of 4 and a remainder)
def test_matches_the_reference_on_the_dequantized_weights(types, N):
    H, inter = (512, 256) if "Q8_0" not in types else (768, 256)
    _, _, mats, deq = gguf_experts([types] * 3, H, inter, seed=N)
    idx, tw = routing(N, 3, seed=N)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(10 + N))
    ref = reference(x, deq, idx, tw)
    for name in kernel_backends():  # (the fp32 backends take the torch path: the last line)
        out = ce.cpu_experts_forward(x, mats, idx, tw, threads=2, backend=name)
        assert rel_err(out, ref) <= ce.tolerance(name, "gguf"), (name, rel_err(out, ref))
        if name != kernel_backends()[0]:  # (the emulation: bit-identical to avx512_bf16, tested below)
            continue
        for e in range(len(mats)):  # each expert against its dequantized weights, the kernel's own rounding only
            one = ce.cpu_experts_forward(x, mats[e:e + 1], idx[e:e + 1], tw[e:e + 1], backend=name)
            assert rounded_apart(x, one, deq[e:e + 1], idx[e:e + 1], tw[e:e + 1]) < OWN_ROUNDING, (name, e)
    assert torch.equal(ce.cpu_experts_forward(x, mats, idx, tw, backend="torch"), ref)


@needs_kernel
def test_q8_0_rows_with_a_lone_last_block():
    """Q8_0 is read two blocks a step: H = 96 and I = 160 leave one 32-value block to the scalar tail."""
    _, _, mats, deq = gguf_experts([("Q8_0",) * 3] * 2, 96, 160, seed=3)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    idx, tw = [torch.tensor([0, 2]), torch.tensor([1])], [torch.tensor([0.3, 0.9]), torch.tensor([0.5])]
    for name in kernel_backends():
        for e in range(2):
            one = ce.cpu_experts_forward(x, mats[e:e + 1], idx[e:e + 1], tw[e:e + 1], backend=name)
            assert rounded_apart(x, one, deq[e:e + 1], idx[e:e + 1], tw[e:e + 1]) < OWN_ROUNDING, (name, e)


@needs_kernel
def test_types_mixed_per_expert_in_one_layout():
    """A store whose tensors mix types per layer (Q4_K_M's): experts of one call in different types, the gate_up
    halves sized for the widest type (up at the section's middle for every expert)."""
    fmt = ExpertFormat("gguf", ggml=(("Q2_K", "Q4_K", "Q8_0"), ("Q4_K", "Q6_K"), ("Q4_K", "Q6_K", "Q2_K")))
    types = [("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q6_K", "Q4_K"), ("Q8_0", "Q4_K", "Q2_K")]
    _, _, mats, deq = gguf_experts(types, 512, 256, fmt=fmt, seed=4)
    idx, tw = routing(4, 3, seed=2)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    ref = reference(x, deq, idx, tw)
    for name in kernel_backends():
        assert rel_err(ce.cpu_experts_forward(x, mats, idx, tw, threads=3, backend=name), ref) <= ce.tolerance(name, "gguf")
        for e in range(3):
            one = ce.cpu_experts_forward(x, mats[e:e + 1], idx[e:e + 1], tw[e:e + 1], backend=name)
            assert rounded_apart(x, one, deq[e:e + 1], idx[e:e + 1], tw[e:e + 1]) < OWN_ROUNDING, (name, e)


@needs_kernel
@pytest.mark.parametrize("t", READ)
def test_avx512_bf16_is_bit_identical_to_its_emulation(t):
    if "avx512_bf16" not in ce.available_backends():
        pytest.skip("avx512_bf16 not available on this CPU")
    _, _, mats, _ = gguf_experts([(t, t, t), (t, "Q4_K", t)], 512, 256, seed=5)
    for N in (1, 2, 3, 5):
        idx, tw = routing(N, 2, seed=N)
        x = torch.randn(N, 512, generator=torch.Generator().manual_seed(N))
        got = ce.cpu_experts_forward(x, mats, idx, tw, threads=3, backend="avx512_bf16")
        assert torch.equal(got, ce.cpu_experts_forward(x, mats, idx, tw, threads=2, backend="avx512_bf16_emulated"))


@needs_kernel
def test_thread_counts_and_knobs_change_no_bit():
    _, _, mats, _ = gguf_experts([("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q8_0", "Q4_K")] * 2, 512, 512, seed=6)
    idx, tw = routing(3, 4, seed=1)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    name = kernel_backends()[0]
    outs = [ce.cpu_experts_forward(x, mats, idx, tw, threads=t, backend=name) for t in (1, 2, 3, 5)]
    old = ce.tune(claim_ahead=0, down_split=0, chunk_min=600)
    try:
        outs.append(ce.cpu_experts_forward(x, mats, idx, tw, threads=3, backend=name))
    finally:
        ce.tune(**old)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@needs_kernel
def test_split_experts_compute_their_leading_rows():
    """run_packed on blobs by address (pinned slots), each expert's first r of I rows: down rows end inside a
    block (200: no whole superblock; 300: one and a partial one), read value by value past the last whole step."""
    H, inter = 256, 512
    layout, blobs, _, deq = gguf_experts([("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q2_K", "Q4_K"), ("Q8_0",) * 3], H, inter,
                                         seed=7)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    idx, w = torch.tensor([0, 2]), torch.tensor([0.7, 0.4])
    rows = [inter, 200, 300]
    meta, scales = array.array("q"), array.array("q")
    ref = torch.zeros(3, H)
    for blob, (gu, dn), r in zip(blobs, deq, rows, strict=True):
        gu_p, dn_p, gus, dns = slot_pointers(layout, blob.data_ptr())
        meta.extend((gu_p, dn_p, idx.data_ptr(), w.data_ptr(), 2, r, inter))
        scales.extend((gus, dns))
        h = F.silu(x[idx] @ gu[:r].T) * (x[idx] @ gu[inter: inter + r].T)
        ref.index_add_(0, idx, (h @ dn[:, :r].T) * w[:, None])
    outs = []
    for name in kernel_backends():
        out = torch.zeros(3, H)
        assert ce.run_packed(x, meta, out, threads=2, backend=name, fmt=layout.fmt, scales=scales)
        assert rel_err(out, ref) <= ce.tolerance(name, "gguf"), name
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_types_a_backend_does_not_read_take_the_torch_path(monkeypatch):
    """The fp32 backends read no GGUF type; a format with a type a backend's GGUF_TYPES lacks is not read by it."""
    q4 = ExpertFormat("gguf", ggml=(("Q4_K", "Q2_K"), ("Q4_K",), ("Q6_K", "Q3_K")))
    assert quant.reads("cpu_kernel", q4)
    for name in ("avx512", "avx2", "torch"):
        assert ce.backend(name, q4) == "torch"
    if "avx512_bf16" in ce.available_backends():
        assert ce.backend(None, q4) == ce.backend("avx512_bf16", "gguf") == "avx512_bf16"
    _, _, mats, deq = gguf_experts([("Q4_K", "Q4_K", "Q3_K")], 256, 256, seed=8)
    x, idx, tw = torch.randn(2, 256), [torch.tensor([0, 1])], [torch.tensor([0.5, 1.0])]
    for name in GGUF_TYPES:
        monkeypatch.setitem(GGUF_TYPES, name, GGUF_TYPES[name] - {"Q3_K"})
    assert ce.backend(None, q4) == "torch"
    assert torch.equal(ce.cpu_experts_forward(x, mats, idx, tw), reference(x, deq, idx, tw))


@needs_kernel
def test_the_header_names_the_types_and_bad_ones_are_refused():
    layout, blobs, mats, _ = gguf_experts([("Q4_K", "Q4_K", "Q6_K")], 256, 256, seed=9)
    x, idx, tw = torch.randn(1, 256), [torch.tensor([0])], [torch.ones(1)]
    blobs[0][2] = 99  # down's type id: not a ggml type
    with pytest.raises(ValueError, match="ggml type id 99"):
        ce.cpu_experts_forward(x, mats, idx, tw)
    gu, dn = mats[0]
    cut = type(gu)(gu.kind, gu.values[:-256], gu.scales, gu.shape)  # a gate_up section too short for its rows
    blobs[0][2] = 14
    with pytest.raises(ValueError, match="does not fit its sections"):
        ce.cpu_experts_forward(x, [(cut, dn)], idx, tw, backend=kernel_backends()[0])


@needs_kernel
def test_an_engine_computes_gguf_experts_with_the_kernel(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE GGUF (types mixed per layer) through a CPU tier, experts pinned and then evicted: the compiled
    kernel reads every expert as stored (strata.kernels.quant.FAST_PATHS lists gguf for its types), and the
    log-probabilities stay within the bf16 activations' rounding of the dequantized reference's."""
    pytest.importorskip("transformers")
    from gguf_models import VOCAB, build_qwen3_gguf

    from strata import Engine

    _, path = build_qwen3_gguf(tmp_path / "gguf", [("Q4_K", "Q4_K", "Q6_K"), ("Q3_K", "IQ4_XS", "Q2_K")])
    calls: list[str] = []
    run_packed = ce.run_packed

    def spy(*args, fmt=None, **kwargs):
        calls.append(fmt.kind if fmt is not None else "bf16")
        return run_packed(*args, fmt=fmt, **kwargs)

    monkeypatch.setattr(ce, "run_packed", spy)
    prompt = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    fp32 = {"dtype": "float32", "max_context": 256}
    disk = {"path": str(tmp_path / "cache"), "scrub": False}
    with Engine.from_pretrained(path, device="cpu", config={"runtime": {**fp32, "cpu_numerics": "gpu"},
                                                            "tiers": {"disk": disk}}) as reference:
        want = reference.score(prompt)
    assert not calls  # (the reference math: no kernel)
    for budget in ("64MiB", "600KiB"):  # every expert pinned (slot addresses), then evictions (handles)
        calls.clear()
        cfg = {"runtime": fp32, "tiers": {"pinned": {"budget": budget}, "disk": disk}}
        with Engine.from_pretrained(path, device="cpu", config=cfg) as tiered:
            got = tiered.score(prompt)
            evictions = tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"]
        assert (evictions > 0) == (budget == "600KiB")
        assert calls and set(calls) == {"gguf"}, budget
        assert (got - want).abs().max().item() < 5e-3  # (1.0e-3 measured: the activations in bf16)


def test_the_plan_says_which_gguf_files_the_kernel_reads(tmp_path, monkeypatch):
    """`strata plan` on a GGUF file with no GPU: the compiled kernel for a Q4_K_M-like mix; a file with a type the
    kernel did not read (Q3_K, taken off its list here) falls back to dequantizing each expert, and says so."""
    pytest.importorskip("transformers")
    from gguf_models import build_qwen3_gguf

    from strata.runtime.plan.host import HostInfo
    from strata.runtime.plan.planner import plan

    GiB = 1 << 30
    cpu_only = HostInfo(gpus=[], ram_total=64 * GiB, ram_available=64 * GiB, tmpfs_path="/dev/shm/strata",
                        tmpfs_free=8 * GiB, disk_path=str(tmp_path), disk_free=64 * GiB, cpu_count=2)
    _, read = build_qwen3_gguf(tmp_path / "read", [("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q2_K", "Q8_0")])
    _, other = build_qwen3_gguf(tmp_path / "other", [("Q4_K", "Q4_K", "Q6_K"), ("Q3_K", "Q4_K", "Q4_K")])
    fast = plan(read, cpu_only)
    monkeypatch.setitem(quant.GGUF_FAST_TYPES, "cpu_kernel", quant.GGUF_FAST_TYPES["cpu_kernel"] - {"Q3_K"})
    slow = plan(other, cpu_only)
    assert fast.decode == "experts on CPU threads from RAM, the compiled kernel"
    assert "does not read" not in " ".join(fast.notes)
    assert "dequantized one by one" in slow.decode
    assert "compiled CPU kernel does not read gguf Q4_K/Q3_K/Q6_K experts" in " ".join(slow.notes)


"""The CPU expert kernel (strata.kernels.cpu.experts) against the reference expert math.

The reference is `expert_swiglu` in fp32 on the same bf16 weights upcast, experts added in the order
given. The extension is built once per test session (into the session's $STRATA_CACHE, a few seconds).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F

from strata.kernels.cpu import experts as ce
from strata.kernels.cpu import library as cpu_lib
from strata.kernels.experts import expert_swiglu

X86 = platform.machine().lower() in ("x86_64", "amd64")
CAN_BUILD = X86 and shutil.which("c++") is not None and shutil.which("ninja") is not None
SHAPES = [(64, 32), (200, 77), (37, 5), (256, 96), (130, 19)]  # (H, I): tails of 8/16/32, odd I


def make_experts(H: int, inter: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert one bf16 blob [gate_up | down], like a store slot."""
    g = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(count):
        blob = (torch.randn(3 * inter * H, generator=g) / H**0.5).to(torch.bfloat16)
        experts.append((blob[: 2 * inter * H].view(2 * inter, H), blob[2 * inter * H:].view(H, inter)))
    return experts


def make_routing(N: int, E: int, k: int, seed: int = 0, empty: tuple[int, ...] = ()):
    """Top-k style routing of N tokens over E experts: per expert (int64 rows, fp32 weights)."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])  # [N, k], distinct per token
    w = torch.rand(N, k, generator=g)
    idx, tw = [], []
    for e in range(E):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if e in empty:
            rows, slot = rows[:0], slot[:0]
        idx.append(rows.to(torch.int64))
        tw.append(w[rows, slot].contiguous())
    return idx, tw


def reference(x, experts, idx, tw, out=None):
    out = torch.zeros(x.shape, dtype=torch.float32) if out is None else out.clone()
    x32 = x.float()
    for (gu, dn), i, w in zip(experts, idx, tw, strict=True):
        if i.numel():
            out.index_add_(0, i, expert_swiglu(x32[i], gu.float(), dn.float()) * w[:, None])
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def tol(name: str, inter: int) -> float:
    """TOLERANCE holds for realistic widths; the bf16 path's error is relative to max |out|, and with a
    tiny intermediate width (I < 16: few terms, more cancellation) it can reach 2-3x that."""
    return ce.TOLERANCE[name] * (3 if "bf16" in name and inter < 16 else 1)


EMULATED = ["avx512_emulated", "avx512_bf16_emulated"]


def kernel_backends() -> list[str]:
    return [b for b in ce.available_backends() if b != "torch"]


def _testable_backends() -> list[str]:
    """What runs here, plus the AVX-512 kernels' emulations wherever the extension loads."""
    return ce.available_backends() + (EMULATED if kernel_backends() else [])


def test_extension_builds_where_it_can():
    names = kernel_backends()
    if not CAN_BUILD:
        pytest.skip("no x86-64 compiler and ninja here: the torch fallback is what runs")
    assert ce.backend() in names, f"extension did not load (backends {ce.available_backends()})"
    assert ce.backend() == names[0]
    assert cpu_lib.build_seconds is not None


@pytest.mark.parametrize("H,inter", SHAPES)
@pytest.mark.parametrize("N", [1, 3, 8, 40])
def test_matches_reference(H, inter, N):
    E, k = 6, 4
    experts = make_experts(H, inter, E, seed=H + inter)
    idx, tw = make_routing(N, E, k, seed=N, empty=(2,))
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    ref = reference(x, experts, idx, tw)
    for name in _testable_backends():
        out = ce.cpu_experts_forward(x, experts, idx, tw, threads=2, backend=name)
        assert rel_err(out, ref) <= tol(name, inter), name


@pytest.mark.parametrize("name", ["avx2", "avx512", "avx512_bf16", *EMULATED])
def test_kernel_many_tokens_per_expert(name, monkeypatch):
    """More tokens than one register tile (and than MAX_TOKENS, raised here so the kernel runs them)."""
    if name not in _testable_backends():
        pytest.skip(f"{name} not available on this CPU")
    monkeypatch.setattr(ce, "MAX_TOKENS", 1000)
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: False)  # on an AMX CPU torch's GEMMs would take them
    H, inter, N = 130, 19, 40
    experts = make_experts(H, inter, 3)
    idx = [torch.arange(N), torch.arange(0, N, 3), torch.arange(N - 1, -1, -1)]
    tw = [torch.rand(len(i)) for i in idx]
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    out = ce.cpu_experts_forward(x, experts, idx, tw, threads=2, backend=name)
    assert rel_err(out, reference(x, experts, idx, tw)) <= ce.TOLERANCE[name]


def test_accumulates_into_out_and_bf16_input():
    H, inter, N, E = 96, 40, 5, 4
    experts = make_experts(H, inter, E)
    idx, tw = make_routing(N, E, 2)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    base = torch.randn(N, H, generator=torch.Generator().manual_seed(2))
    ref = reference(x, experts, idx, tw, out=base)
    for name in _testable_backends():
        out = base.clone()
        got = ce.cpu_experts_forward(x, experts, idx, tw, out=out, backend=name)
        assert got is out
        assert rel_err(out, ref) <= ce.TOLERANCE[name], name
    # a non-contiguous accumulator is added into as well
    wide = torch.zeros(N, 2 * H)
    view = wide[:, ::2]
    view.copy_(base)
    ce.cpu_experts_forward(x, experts, idx, tw, out=view)
    assert rel_err(view, ref) <= ce.TOLERANCE[ce.backend()]
    assert wide[:, 1::2].abs().max() == 0


def test_duplicate_experts_and_repeated_calls():
    """The same expert buffers twice in one call, and again in the next call: same answers."""
    H, inter, N = 72, 24, 4
    a, b = make_experts(H, inter, 2)
    experts = [a, b, a, a]
    idx = [torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([0, 1, 3]), torch.tensor([], dtype=torch.int64)]
    tw = [torch.tensor([0.5, 0.25]), torch.tensor([1.0]), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([])]
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    ref = reference(x, experts, idx, tw)
    first = ce.cpu_experts_forward(x, experts, idx, tw)
    second = ce.cpu_experts_forward(x, experts, idx, tw)
    assert torch.equal(first, second)
    assert rel_err(first, ref) <= ce.TOLERANCE[ce.backend()]


def test_no_tokens_at_all():
    H, inter, N = 40, 8, 3
    experts = make_experts(H, inter, 2)
    empty = [torch.tensor([], dtype=torch.int64)] * 2
    out = ce.cpu_experts_forward(torch.randn(N, H), experts, empty, [torch.tensor([])] * 2)
    assert out.shape == (N, H) and out.abs().max() == 0


@pytest.mark.parametrize("N", [1, 8, 30])
def test_bit_identical_across_thread_counts(N):
    names = [b for b in _testable_backends() if b != "torch"]
    if not names:
        pytest.skip("extension not available")
    H, inter, E = 256, 96, 8
    experts = make_experts(H, inter, E, seed=7)
    idx, tw = make_routing(N, E, min(E, 8), seed=3)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    for name in names:
        outs = [ce.cpu_experts_forward(x, experts, idx, tw, threads=t, backend=name) for t in (1, 2, 3, 5, 1)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), name


def test_concurrent_callers():
    """Calls from several Python threads at once (the GIL is released inside) stay correct."""
    H, inter, N, E = 128, 48, 4, 6
    experts = make_experts(H, inter, E)
    idx, tw = make_routing(N, E, 3)
    xs = [torch.randn(N, H) for _ in range(4)]
    refs = [ce.cpu_experts_forward(x, experts, idx, tw, threads=2) for x in xs]
    errors = []

    def work(i):
        for _ in range(20):
            got = ce.cpu_experts_forward(xs[i], experts, idx, tw, threads=2)
            if not torch.equal(got, refs[i]):
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_requested_backend_runs_and_backend_reports_it():
    """`backend=` (an engine's `[debug] cpu_kernel`) picks the path of that call only: "torch" is the reference
    math; the process's choice stays the best this CPU runs."""
    H, inter, N, E = 64, 16, 3, 3
    experts = make_experts(H, inter, E)
    idx, tw = make_routing(N, E, 2)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    assert ce.backend("torch") == "torch"
    out = ce.cpu_experts_forward(x, experts, idx, tw, backend="torch")
    assert torch.equal(out, reference(x, experts, idx, tw))  # the torch path is the reference math
    assert ce.backend("avx2") == ("avx2" if "avx2" in kernel_backends() else ce.backend("auto"))
    assert ce.backend() == ce.backend("auto") == (kernel_backends() or ["torch"])[0]
    assert ce.isa_code("torch") == 0 and ce.isa_code() == cpu_lib._ISA.get(ce.backend(), 0)


def test_unknown_or_unsupported_request_warns_and_chooses(monkeypatch, caplog):
    monkeypatch.setattr(cpu_lib, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=cpu_lib.__name__):
        assert ce.backend("fastest-please") == ce.backend("auto")
        ce.backend("fastest-please")
    assert sum("unknown CPU kernel" in r.message for r in caplog.records) == 1
    missing = [b for b in ("avx512_bf16", "avx512", "avx2") if b not in kernel_backends()]
    if kernel_backends() and missing:
        assert ce.backend(missing[0]) == ce.backend("auto")


def test_a_first_build_says_so_on_a_terminal_and_later_calls_reuse_it(monkeypatch, tmp_path, capsys):
    """A minute of compiling is announced on a terminal's stderr, once: not when the library is already built. Every
    call in a process asks for the same build (torch appends its flags to the lists it is given)."""
    if not CAN_BUILD:
        pytest.skip("no x86-64 compiler and ninja here")
    from torch.utils import cpp_extension

    from strata.kernels.cpu import build

    real_load, calls, built = cpp_extension.load, [], []

    def load(name, build_directory, **kw):  # in tmp_path: what compiling leaves (a link: dlopen gives the same library)
        calls.append(name)
        if not build_directory.startswith(str(tmp_path)):
            built.append(real_load(name=name, build_directory=build_directory, **kw))
            return built[-1]
        if not os.path.exists(f"{build_directory}/{name}.so"):
            os.symlink(built[0], f"{build_directory}/{name}.so")
        return f"{build_directory}/{name}.so"

    monkeypatch.setattr(cpp_extension, "load", load)
    build.build_and_open()  # the library this machine already has
    build.build_and_open()
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(build.sys.stderr, "isatty", lambda: True)
    build.build_and_open()
    build.build_and_open()
    err = capsys.readouterr().err
    assert len(calls) == 4 and len(set(calls)) == 1
    assert err.count("compiling the CPU kernels for this machine") == 1


def test_build_failure_falls_back_to_torch(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Error building extension 'x': c++: error: no such compiler\nmore lines")

    monkeypatch.setattr(cpu_lib, "_lib", None)
    monkeypatch.setattr(cpu_lib, "_lib_tried", False)
    monkeypatch.setattr(cpu_lib, "build_and_open", broken)
    H, inter, N, E = 48, 8, 2, 2
    experts = make_experts(H, inter, E)
    idx, tw = make_routing(N, E, 1)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    with caplog.at_level(logging.WARNING, logger=cpu_lib.__name__):
        assert ce.backend() == "torch"
        out = ce.cpu_experts_forward(x, experts, idx, tw)
        ce.backend()
    warnings = [r for r in caplog.records if "unavailable" in r.message]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert torch.equal(out, reference(x, experts, idx, tw))


def test_bad_arguments():
    H, inter, N = 40, 8, 3
    experts = make_experts(H, inter, 1)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    for name in ce.available_backends():
        with pytest.raises(IndexError):
            ce.cpu_experts_forward(x, experts, [torch.tensor([0, N])], [torch.ones(2)], backend=name)
    with pytest.raises(ValueError):
        ce.cpu_experts_forward(x, [(experts[0][0][:, :-1], experts[0][1])], [torch.tensor([0])], [torch.ones(1)])
    with pytest.raises(ValueError):
        ce.cpu_experts_forward(x, experts, [torch.tensor([0, 1])], [torch.ones(1)])
    with pytest.raises(ValueError):
        ce.cpu_experts_forward(x, experts, [torch.tensor([0])], [torch.ones(1)], out=torch.zeros(N, H + 1))


def emulate_avx512_bf16(x, experts, idx, tw):
    """The avx512_bf16 backend's numerics in float64: x and silu(gate)*up rounded to bf16 (RNE)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    xb = x.float().to(torch.bfloat16).double()
    for (gu, dn), i, w in zip(experts, idx, tw, strict=True):
        if i.numel():
            gate, up = (xb[i] @ gu.double().T).chunk(2, dim=-1)
            h = (F.silu(gate) * up).float().to(torch.bfloat16).double()
            out.index_add_(0, i, (h @ dn.double().T) * w.double()[:, None])
    return out.float()


@pytest.mark.parametrize("H,inter", [(2048, 768), (200, 77)])
def test_avx512_bf16_tolerance(H, inter):
    """TOLERANCE['avx512_bf16'] covers the two bf16 roundings (x, and silu(gate)*up): a float64
    emulation of those numerics stays within it, and the kernel's portable emulation agrees with the
    float64 one (which also checks its fp32 -> bf16 rounding against torch's)."""
    N, E = 4, 8
    experts = make_experts(H, inter, E, seed=11)
    idx, tw = make_routing(N, E, 8, seed=5)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
    ref = reference(x, experts, idx, tw)
    emu = emulate_avx512_bf16(x, experts, idx, tw)
    assert rel_err(emu, ref) <= ce.TOLERANCE["avx512_bf16"]
    if kernel_backends():
        got = ce.cpu_experts_forward(x, experts, idx, tw, backend="avx512_bf16_emulated")
        assert rel_err(got, emu) <= 1e-4


@pytest.mark.parametrize("name", ["avx512", "avx512_bf16"])
def test_avx512_kernels_match_their_emulation(name):
    """On a CPU with AVX-512 (the GPU box): the real kernel against its portable emulation, which
    follows the same lane layout and order. avx512 (vector FMA, fixed horizontal sum) must be
    bit-identical; avx512_bf16 too if vdpbf16ps rounds as Intel's pseudo-code says (odd pair, then
    even pair), and within 1e-4 in any case (a wrong lane or tail is off by far more)."""
    if name not in kernel_backends():
        pytest.skip(f"{name} not available on this CPU")
    for (H, inter), N in [((2048, 768), 1), ((2048, 768), 4), ((200, 77), 8), ((37, 5), 3), ((130, 19), 30)]:
        E = 8
        experts = make_experts(H, inter, E, seed=H + N)
        idx, tw = make_routing(N, E, min(E, 6), seed=N)
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
        got = ce.cpu_experts_forward(x, experts, idx, tw, threads=3, backend=name)
        emu = ce.cpu_experts_forward(x, experts, idx, tw, threads=2, backend=f"{name}_emulated")
        if name == "avx512":
            assert torch.equal(got, emu), (H, inter, N, rel_err(got, emu))
        else:
            assert rel_err(got, emu) <= 1e-4, (H, inter, N)


@pytest.fixture
def _restore_knobs():
    old = ce.tune(claim_ahead=0, chunk_div=8, chunk_min=32 << 10, chunk_max=512 << 10, down_split=0, down_stream=0)
    yield
    ce.tune(**old)
    ce.trace(False)


def test_scheduling_knobs_keep_results_bit_identical(_restore_knobs):
    """Claiming down chunks ahead, chunk sizes, each expert's least run of down rows and the down rows' pairing change
    who computes what, never the sums."""
    names = [b for b in _testable_backends() if b not in ("torch", "avx512_bf16_emulated", "avx512_emulated")]
    if not names:
        pytest.skip("extension not available")
    ce.trace(True)
    calls = nbytes = 0
    for H, inter in [(512, 192), (131, 19)]:  # the second: an odd row count in a down chunk (one row unpaired)
        N, E = 3, 6
        experts = make_experts(H, inter, E, seed=11)
        idx, tw = make_routing(N, E, 4, seed=5)
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(9))
        ce.tune(claim_ahead=0, chunk_div=8, chunk_min=32 << 10, chunk_max=512 << 10, down_split=0, down_stream=0)
        ref = ce.cpu_experts_forward(x, experts, idx, tw, threads=1, backend=names[0])
        calls, nbytes = calls + 1, nbytes + 3 * inter * H * 2 * sum(1 for i in idx if i.numel())
        for claim, div, lo, split, run in [(0, 8, 32 << 10, 0, 0), (2, 8, 4096, 1, 16 << 10), (16, 64, 2048, 1, 0),
                                           (16, 1, 2048, 0, 1 << 20), (1, 8, 1 << 20, 1, 4096), (0, 64, 600, 1, 0)]:
            ce.tune(claim_ahead=claim, chunk_div=div, chunk_min=lo, chunk_max=max(lo, 512 << 10), down_split=split,
                    down_stream=run)
            for threads in (1, 2, 3, 5):
                got = ce.cpu_experts_forward(x, experts, idx, tw, threads=threads, backend=names[0])
                calls, nbytes = calls + 1, nbytes + 3 * inter * H * 2 * sum(1 for i in idx if i.numel())
                assert torch.equal(got, ref), (H, claim, div, lo, split, run, threads)
    t = ce.trace(False)
    assert t["calls"] == calls
    assert t["bytes"] == nbytes
    assert t["threads_joined"] >= calls  # the caller always joins
    assert 0 < t["phase1_ns"] + t["phase2_ns"] <= t["call_ns"]
    assert t["phase1_chunks"] >= calls
    assert ce.trace(None)["calls"] == calls  # off: no more calls counted
    ce.cpu_experts_forward(x, experts, idx, tw, threads=2, backend=names[0])
    assert ce.trace(None)["calls"] == calls


def test_tune_rejects_unknown_or_negative_knobs():
    if not kernel_backends():
        pytest.skip("extension not available")
    with pytest.raises(ValueError, match="unknown CPU kernel knob 'chunks'"):
        ce.tune(chunks=3)
    with pytest.raises(ValueError, match="must be >= 0"):
        ce.tune(claim_ahead=-1)
    old = ce.tune(claim_ahead=40)
    try:
        assert ce.tune(claim_ahead=old["claim_ahead"])["claim_ahead"] == 16  # clamped to the kernel's limit
    finally:
        ce.tune(**old)


def test_knobs_from_text_are_checked():
    """`parse_knobs` (the probes' --knobs): name=integer items, a bad one named with where it came from."""
    from strata.kernels.cpu.tuning import parse_knobs

    assert parse_knobs("claim_ahead=3, chunk_div=16", "--knobs") == {"claim_ahead": 3, "chunk_div": 16}
    for bad in ("claim_ahead", "claim=2", "chunk_div=-1", "chunk_div=x"):
        with pytest.raises(ValueError, match="--knobs: bad item"):
            parse_knobs(bad, "--knobs")


@pytest.mark.parametrize("name", ["avx512", "avx512_bf16", *EMULATED])
def test_four_row_tile_with_leftover_rows_and_tokens(name, monkeypatch, _restore_knobs):
    """Experts with 4 tokens or more take their rows four at a time, six tokens a tile (cpu_experts_tile4.h; 4 or 5:
    one tile), one with 3 two at a time, in one call: token counts not multiples of six, odd I and H off the vector
    width leave rows and tokens to the two-row tile; chunk sizes and pairings regroup the rows (which rows go four at
    a time), never the sums; against the reference and, for the real kernels, their emulation."""
    if name not in _testable_backends():
        pytest.skip(f"{name} not available on this CPU")
    monkeypatch.setattr(ce, "MAX_TOKENS", 1000)
    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: False)  # on an AMX CPU torch's GEMMs would take them
    for H, inter in [(130, 19), (200, 77)]:
        N, E = 60, 8
        experts = make_experts(H, inter, E, seed=H)
        idx = [torch.arange(0, N, 4), torch.arange(3, 28), torch.arange(N - 1, 16, -1), torch.arange(7), torch.arange(N),
               torch.arange(4), torch.arange(9, 14), torch.arange(3)]  # 15, 25, 43, 7, 60; 4 and 5: one tile; 3: dot2
        tw = [torch.rand(len(i), generator=torch.Generator().manual_seed(len(i))) for i in idx]
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(N * 1000 + H))
        ref = ce.cpu_experts_forward(x, experts, idx, tw, threads=1, backend=name)
        assert rel_err(ref, reference(x, experts, idx, tw)) <= tol(name, inter), (name, H)
        for lo, split in [(600, 0), (2048, 1), (1 << 20, 1)]:
            ce.tune(chunk_min=lo, chunk_max=max(lo, 512 << 10), down_split=split, down_stream=0)
            for threads in (2, 3):
                got = ce.cpu_experts_forward(x, experts, idx, tw, threads=threads, backend=name)
                assert torch.equal(got, ref), (name, H, lo, split, threads)
        if name in kernel_backends():
            emu = ce.cpu_experts_forward(x, experts, idx, tw, threads=2, backend=f"{name}_emulated")
            assert (torch.equal(ref, emu) if name == "avx512" else rel_err(ref, emu) <= 1e-4), (name, H)

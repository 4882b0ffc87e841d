"""How many builds the per-layer decode kernels cost (strata.runtime.offload.decode_builds): Triton builds a kernel once per
specialization key, made of its constexprs and, for each plain int argument, the value's class (1, a multiple of 16,
other), for each pointer its alignment. The mailbox pack and the warm-ahead plan run once per MoE layer in each
decode batch size's CUDA graph, so an int carrying the layer or the batch size would have the serving warm-up
(strata.runtime.generation.warmup) build them again per layer class and batch class. The keys come from Triton's own binder,
for an H200 (sm_90) target, on CPU tensors, without launching anything (strata.kernels.gpu.builds)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

pytest.importorskip("triton")

from strata.kernels.gpu.builds import Unavailable, as_on_the_gpu, recorded_launches, triton_kernels  # noqa: E402
from strata.runtime.offload import decode_builds as db  # noqa: E402

LAYERS = 48  # the bench model's depth: layer 1 and each multiple of 16 are int classes of their own
MAX_BATCH, TOP_K = 8, 8  # the serving default's max batch: one graph per size


def _keys(fn):
    """{kernel: keys} of the launches `fn` makes (skipped where this Triton's binder is not the one the probe knows)."""
    with contextlib.ExitStack() as stack:
        try:
            keys = stack.enter_context(recorded_launches())
        except Unavailable as e:
            pytest.skip(str(e))
        fn()
    return keys


def _pair_blocks() -> set[int]:
    """The pair block (`BLOCK_P`, pairs rounded up to a power of two) of each batch size: 8, 16, 32, 64."""
    return {max(2, 1 << (n * TOP_K - 1).bit_length()) for n in range(1, MAX_BATCH + 1)}


def test_a_decode_layers_exchange_and_plan_build_once_per_pair_block_not_per_layer_or_batch_class():
    """The real mailbox's and warm-ahead's buffers (their layouts decide the pointers' alignment) over 48 layers and
    batch sizes 1-8: one key per pair block for the fused pack and the plan, one for the fetch's two kernels.
    Specialized, the pack made 12 keys (N and P: 6, twice over by each layer's counter's alignment) and the plan 24
    (P, the layer's tag and its parity row's alignment)."""
    with contextlib.ExitStack() as stack:
        try:
            box, share, ahead = stack.enter_context(db.decode_objects(LAYERS, MAX_BATCH, TOP_K))
        except Unavailable as e:
            pytest.skip(str(e))
        one = _keys(lambda: [db.exchange_launch(box, share, layer, 1) for layer in range(LAYERS)])
        keys = _keys(lambda: [(db.exchange_launch(box, share, layer, n),
                               ahead.plan(layer, torch.zeros(n, TOP_K, dtype=torch.int64)) if layer else None)
                              for n in range(1, MAX_BATCH + 1) for layer in range(LAYERS)])
    assert len(one["_pack_kernel"]) == 1  # batch size 1, all 48 layers: one build
    assert len(keys["_pack_kernel"]) == len(keys["_plan_kernel"]) == len(_pair_blocks()) == 4
    assert len(keys["_acquire_kernel"]) == len(keys["_read_kernel"]) == 1


def test_the_decode_cache_write_builds_once_for_every_batch_size():
    """`norm_rope_into_cache` with the queries: its B * Q_HEADS bound is not specialized (4 query heads: 4, 8, 12,
    16, ... would be two classes)."""
    from strata.kernels.gpu import fused

    heads, q_heads, d = 2, 4, 64
    cache = torch.zeros(8, 32, heads, d, dtype=torch.bfloat16)
    ones = torch.ones(d, dtype=torch.bfloat16)

    def launches():
        for b in range(1, MAX_BATCH + 1):
            qkv = torch.zeros(b, (q_heads + 2 * heads) * d, dtype=torch.bfloat16)  # one projection's output, split
            q, k, v = qkv.split([q_heads * d, heads * d, heads * d], dim=1)
            cos = torch.zeros(b, d, dtype=torch.bfloat16)
            pos = torch.zeros(b, dtype=torch.int64)
            fused.norm_rope_into_cache(k.view(b, heads, d), v.view(b, heads, d), cos, cos, ones, 1e-6, cache,
                                       cache.clone(), pos, pos, q=q.view(b, q_heads, d), q_weight=ones, q_eps=1e-6)

    assert len(_keys(launches)["_norm_rope_cache_kernel"]) == 1


def test_decode_attention_sinks_are_a_build_of_their_own():
    """gpt-oss's sinks and window builds (`decode_attention`'s SINKS, WINDOW) leave the plain builds as they were: one
    split build, a merge build per power of two of splits (buckets 256, 512 and 1024 here: 2, 4 and 8 splits), the
    sinks pointer a constexpr None in them (no argument: the compiled kernel is the one without the option). The
    sinks add as many merge builds, the window one split build, none per batch size."""
    from strata.kernels.gpu.decode_attention import decode_attention

    bf, heads, kv_heads, d = torch.bfloat16, 64, 8, 64

    def launches(window, sinks):
        for b in range(1, MAX_BATCH + 1):
            for length in (256, 512, 1024):
                q, cache = torch.zeros(b, heads, d, dtype=bf), torch.zeros(4, length, kv_heads, d, dtype=bf)
                pos = torch.zeros(b, dtype=torch.int64)
                decode_attention(q, cache, cache, pos, pos, length, window, d ** -0.5, sinks=sinks)

    plain = _keys(lambda: launches(None, None))
    assert len(plain["_split_kernel"]) == 1 and len(plain["_merge_kernel"]) == 3
    assert all("('constexpr', None)" in key for key in plain["_merge_kernel"])
    both = _keys(lambda: (launches(None, None), launches(128, torch.zeros(heads, dtype=bf))))
    assert set(plain["_merge_kernel"]) < set(both["_merge_kernel"]) and len(both["_merge_kernel"]) == 6
    assert set(plain["_split_kernel"]) < set(both["_split_kernel"]) and len(both["_split_kernel"]) == 2


def test_the_recorder_sees_the_classes_it_must_remove():
    """The recorder itself: a kernel without `do_not_specialize` gets a key per int class (1, multiple of 16,
    other) and per constexpr, so the tests above could fail."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, n, B: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, B), tl.zeros([B], dtype=tl.int32), mask=tl.arange(0, B) < n)

    x = torch.zeros(16, dtype=torch.int32)
    keys = _keys(lambda: [_probe[(1,)](x, n, B=b) for n in (1, 2, 3, 16, 32) for b in (8, 16)])
    assert len(keys["_probe"]) == 6


DECODE_KERNELS = {"_pack_kernel", "_acquire_kernel", "_read_kernel", "_plan_kernel", "_rms_norm_kernel",
                  "_add_rms_norm_kernel", "_gemv_kernel", "_norm_rope_cache_kernel", "_split_kernel", "_merge_kernel",
                  "_route_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"}


def test_every_kernel_compiles_for_the_h200(tmp_path, monkeypatch):
    """Every Triton kernel of strata, as its wrapper launches it on the GPU (PDL on), compiles for sm_90 here: a
    decode step's (`--model`: the probe's sweep; gpt-oss's attention with sinks and a window), prefill's rope and
    top-k, Qwen3.5's Gated DeltaNet step and norms, DeepSeek-V4's hyper-connections, rope and norm, and the FP8 / MXFP4 / GGUF experts' kernels
    (GGUF: a Q4_K_M store, down's type picked per expert by its header). The CPU tests run the kernels only through
    Triton's interpreter, which compiles nothing: this catches what only the compiler rejects, on machines without a
    GPU."""
    from strata.kernels.gpu import fused

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    bf = torch.bfloat16

    def others():
        from strata.kernels.gpu.decode_attention import decode_attention

        x, cos = torch.zeros(5, 4, 128, dtype=bf), torch.zeros(5, 128, dtype=bf)
        fused.norm_rope(x, cos, cos, torch.ones(128, dtype=bf), 1e-6)
        # gpt-oss's decode attention: the sinks and window builds (64 heads over 8 KV heads of 64)
        q, cache, pos = torch.zeros(2, 64, 64, dtype=bf), torch.zeros(2, 512, 8, 64, dtype=bf), torch.zeros(2).long()
        decode_attention(q, cache, cache, pos, pos, 512, 128, 0.125, sinks=torch.zeros(64, dtype=bf))
        fused.softmax_topk(torch.zeros(40, 128), 8, True)
        qwen3_5_decode()
        quantized_experts()
        from strata.kernels.gpu import deepseek_v4  # V4's hyper-connection weights (4 streams), rope, fp32-weight norm
        from strata.kernels.gpu import deepseek_v4_attention as v4_attention  # its decode attention's chains

        deepseek_v4.hyper_weights(torch.zeros(1, 24), torch.zeros(24), torch.ones(3),
                                  torch.zeros(1, 4, 4096, dtype=bf), 20, 1e-6)
        streams = torch.zeros(1, 4, 4096, dtype=bf)
        deepseek_v4.mix_streams(streams, streams[:, 0], torch.zeros(1, 4), torch.zeros(1, 4, 4))
        deepseek_v4.rotate(torch.zeros(1, 64, 512, dtype=bf), torch.zeros(1, 32, dtype=bf),
                           torch.zeros(1, 32, dtype=bf), True)
        deepseek_v4.rotate(torch.zeros(1, 64, 512, dtype=bf), torch.zeros(1, 32, dtype=bf),
                           torch.zeros(1, 32, dtype=bf), norm_eps=1e-6)
        deepseek_v4.float_rms_norm(torch.zeros(1, 4096, dtype=bf), torch.ones(4096), 1e-6)
        deepseek_v4.clipped_swiglu(torch.zeros(1, 2048, dtype=bf), torch.zeros(1, 2048, dtype=bf), 10.0)
        logits = torch.zeros(1, 256, dtype=bf)  # V4-Flash's router: top-6 of 256 experts, and a hash layer's
        deepseek_v4.route_weights(logits, "sqrtsoftplus", 1.5, bias=torch.zeros(256), k=6)
        deepseek_v4.route_weights(logits, "sqrtsoftplus", 1.5, ids=torch.zeros(1, 6, dtype=torch.int64))
        v4_attention.sink_softmax(torch.zeros(1, 64, 640, dtype=bf), torch.ones(1, 640, dtype=torch.bool),
                                  torch.zeros(64), 0.0442)
        win, kv, one = torch.zeros(1, 128, 512, dtype=bf), torch.zeros(1, 512, dtype=bf), torch.zeros(1).long()
        ent = torch.zeros(1, 64, 512, dtype=bf)
        for entries, picked in ((None, None), (ent, None), (ent, torch.zeros(1, 512).long())):  # sliding, HCA, CSA
            v4_attention.window_keys(win, kv, one, one, 127, entries, 64, 128, picked)
        for m, d, overlap in ((128, 512, False), (4, 512, True), (4, 128, True)):  # HCA, CSA, CSA's indexer
            width, ring = (2 * d, 2 * m) if overlap else (d, m)
            src, one = torch.zeros(1, ring, width, dtype=bf), torch.zeros(1, dtype=torch.int64)
            v4_attention.compress_step(src, src.clone(), torch.zeros(1, 8, d, dtype=bf),
                                       torch.zeros(1, width, dtype=bf), torch.zeros(1, width, dtype=bf), one, one,
                                       torch.zeros(m, width), torch.ones(d), 1e-6, torch.zeros(1, 32, dtype=bf),
                                       torch.zeros(1, 32, dtype=bf), m, overlap)

    def qwen3_5_decode():  # Qwen3.5's Gated DeltaNet step (16 key heads, 32 value heads of 128) and its norms
        from strata.kernels.gpu import gated_delta

        conv_dim, slots, fresh = 2 * 16 * 128 + 32 * 128, torch.zeros(1).long(), torch.zeros(1, dtype=torch.bool)
        qkv, conv = torch.zeros(1, conv_dim, dtype=bf), torch.zeros(2, conv_dim, 3, dtype=bf)
        x = gated_delta.conv_step(qkv, conv, torch.zeros(conv_dim, 1, 4, dtype=bf), slots, fresh)
        a, hv = torch.zeros(1, 32, dtype=bf), torch.zeros(32, dtype=bf)
        o = gated_delta.delta_step(x, a, a, hv, hv, torch.zeros(2, 32, 128, 128), slots, fresh, 16, 128, 128)
        gated_delta.gated_rms_norm(o.view(-1, 128), o.view(-1, 128), torch.ones(128, dtype=bf), 1e-6)
        h = torch.zeros(1, 2048, dtype=bf)
        gated_delta.zero_centered_rms_norm(h, torch.zeros(2048, dtype=bf), 1e-6, h)

    def quantized_experts():  # FP8, MXFP4 and GGUF slots: resident pairs, in-place reads, prefill's scratch
        from strata.kernels.gpu.experts import grouped, quant_pairs
        from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights, dequantize_into
        from strata.kernels.quant import ExpertFormat, ExpertLayout

        q4_k_m = ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q6_K", "Q4_K")))
        for fmt in (ExpertFormat("fp8", block=(128, 128)), ExpertFormat("mxfp4"), q4_k_m):
            layout = ExpertLayout.build(fmt, db.H, db.INTER)
            slab = torch.zeros(2, -(-layout.payload_bytes // 4096) * 4096, dtype=torch.uint8)
            x, y, ids = torch.zeros(1, db.H, dtype=bf), torch.zeros(TOP_K, db.H), torch.zeros(TOP_K, dtype=torch.int64)
            used = torch.zeros(TOP_K, dtype=torch.int32)
            # the resident pairs as `pair_experts` launches them on the GPU (slot table `used`, ids the pair index)
            quant_pairs.pair_quant(x, QuantSlotWeights(slab, layout), used, torch.arange(TOP_K, dtype=torch.int32), None,
                                   TOP_K, y, used.clone())
            grouped.pair_experts_in_place(x, grouped.HostExperts.of_layout(layout), ids, y, first_row=used)
            out = torch.empty(2, 2 * db.INTER, db.H, dtype=bf)
            dequantize_into(slab, layout, torch.arange(2), layout.gate_up, layout.gate_up_scales, out)

    try:
        with recorded_launches(compile=True) as keys, as_on_the_gpu():
            db.sweep(3, 2, TOP_K, model=True)
            others()
    except Unavailable as e:
        pytest.skip(str(e))
    built = {name for name, k in keys.items() if k and all(s is not None and s > 0 for s in k.values())}
    quantized = {"_quant_gate_up_kernel", "_quant_down_kernel", "_dequant_kernel", "_gguf_gate_up_kernel",
                 "_gguf_down_kernel", "_gguf_dequant_kernel"}
    qwen3_5 = {"_conv_step_kernel", "_delta_step_kernel", "_gated_norm_kernel", "_zc_norm_kernel"}
    v4 = {"_hyper_kernel", "_mix_kernel", "_rotate_kernel", "_float_norm_kernel", "_sink_softmax_kernel",
          "_compress_kernel", "_keys_kernel", "_router_weights_kernel", "_clipped_swiglu_kernel"}
    assert built == DECODE_KERNELS | {"_norm_rope_kernel", "_softmax_topk_kernel"} | v4 | quantized | \
        qwen3_5 == triton_kernels()
    # every launch names FP fusion (Triton 3.10 turns its default off): on, but in the GGUF scratch dequantizer, which
    # rounds q * scale - low twice as gguf's numpy does
    fusion = {name: {on for key in k for on in (True, False) if f"('enable_fp_fusion', {on})" in key}
              for name, k in keys.items()}
    assert fusion == {name: {name != "_gguf_dequant_kernel"} for name in keys}


def test_a_swiglu_form_is_one_more_pair_kernel_build_whatever_its_values_and_compiles_for_the_h200(tmp_path,
                                                                                                   monkeypatch):
    """The decode pair kernels with a SwiGLU form and a gate_up bias (strata.kernels.gpu.experts.pair_forms): the plain
    form, passed or left out, is the one build it always was; a form's constexprs (FORM, HAS_BIAS) are one build each,
    whatever its limit, alpha and up_offset (fp32 arguments: DeepSeek-V4's limit 10 and a limit of 7 share a build).
    Every such build compiles for sm_90: plain slots, FP8 / MXFP4 / GGUF blobs, resident and in place."""
    from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
    from strata.kernels.gpu.experts import grouped, quant_pairs
    from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
    from strata.kernels.quant import ExpertFormat, ExpertLayout

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    bf, h, inter = torch.bfloat16, db.H, db.INTER
    gpt_oss = SwiGLUForm(limit=7.0, alpha=1.702, up_offset=1.0, interleaved=True)
    x, y, used = torch.zeros(1, h, dtype=bf), torch.zeros(TOP_K, h), torch.zeros(TOP_K, dtype=torch.int32)
    pairs, addr = torch.arange(TOP_K, dtype=torch.int32), torch.zeros(TOP_K, dtype=torch.int64)
    bias = torch.zeros(TOP_K, 2 * inter, dtype=bf)

    def plain():
        slots = grouped.SlotWeights(torch.empty(2, 2 * inter, h, dtype=bf), torch.empty(2, h, inter, dtype=bf))
        for form in (None, PLAIN_SWIGLU, SwiGLUForm(limit=10.0), SwiGLUForm(limit=7.0)):
            grouped._pair_triton(x, slots, used, pairs, None, TOP_K, y, used.clone(),
                                 **({} if form is None else {"form": form}))
        grouped._pair_triton(x, slots, used, pairs, None, TOP_K, y, used.clone(), gpt_oss, bias)
        experts = grouped.HostExperts(bf, (2 * inter, h), (h, inter), 2 * inter * h * 2)
        grouped.pair_experts_in_place(x, experts, addr, y, first_row=used, form=gpt_oss, gate_up_bias=bias,
                                      expert_ids=pairs)

    def quantized():
        q4_k_m = ExpertFormat("gguf", ggml=(("Q4_K",), ("Q4_K",), ("Q6_K", "Q4_K")))
        for fmt in (ExpertFormat("fp8", block=(128, 128)), ExpertFormat("mxfp4"), q4_k_m):
            form = gpt_oss if fmt.kind != "gguf" else SwiGLUForm(limit=7.0, alpha=1.702, up_offset=1.0)
            layout = ExpertLayout.build(fmt, h, inter)
            slab = torch.zeros(2, -(-layout.payload_bytes // 4096) * 4096, dtype=torch.uint8)
            quant_pairs.pair_quant(x, QuantSlotWeights(slab, layout), used, pairs, None, TOP_K, y, used.clone(),
                                   form=form, gate_up_bias=bias)
            grouped.pair_experts_in_place(x, grouped.HostExperts.of_layout(layout), addr, y, first_row=used,
                                          form=SwiGLUForm(limit=10.0))

    try:
        with as_on_the_gpu():
            with recorded_launches() as keys:
                plain()
            with recorded_launches(compile=True) as compiled:
                plain()
                quantized()
    except Unavailable as e:
        pytest.skip(str(e))
    # resident: plain (left out or passed), FORM 1 (limits 10 and 7), gpt-oss's FORM 7 with a bias; in place: gpt-oss's
    assert len(keys["_gate_up_kernel"]) == 4 and len(keys["_down_kernel"]) == 2
    assert all(s is not None and s > 0 for k in compiled.values() for s in k.values())
    assert {"_gate_up_kernel", "_quant_gate_up_kernel", "_gguf_gate_up_kernel"} <= set(compiled)


def test_the_kernel_list_is_every_jit_kernel_the_gpu_modules_hold():
    """`triton_kernels` reads the sources; imported, strata.kernels.gpu's modules hold the same launchable kernels
    (Triton `JITFunction`s named `_..._kernel`), and its `@triton.jit` helpers (`enter`, `round_to`) are not in it."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import strata.kernels.gpu as gpu

    held = set()
    for info in pkgutil.walk_packages(gpu.__path__, f"{gpu.__name__}."):  # experts/ too
        module = importlib.import_module(info.name)
        held |= {v.fn.__name__ for v in vars(module).values() if isinstance(v, JITFunction)}
    assert {"enter", "round_to"} <= held
    assert triton_kernels() == {name for name in held if name.endswith("_kernel")}


def test_count_builds_compiles_each_key_once_for_sm90(tmp_path, monkeypatch):
    """`count_builds` (what `python bench/kernel_builds.py` prints and writes) compiles each new key for the H200
    here (Triton's own ptxas) and times it, in a JSON-ready report."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    try:
        report = db.count_builds(layers=3, max_batch=2)
    except Unavailable as e:
        pytest.skip(str(e))
    out = json.loads(json.dumps(report))
    assert out["target"] == "sm_90"
    for name in ("_pack_kernel", "_plan_kernel"):  # batch sizes 1 and 2: pair blocks 8 and 16
        assert out["kernels"][name]["builds"] == 2 and out["kernels"][name]["seconds"] > 0
    assert any(line.startswith("_pack_kernel") and line.endswith(" s") for line in db.describe_builds(report))

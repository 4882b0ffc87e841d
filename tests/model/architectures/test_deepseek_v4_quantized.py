"""DeepSeek-V4 checkpoints as its quantized releases spell them (`strata demo-model --arch deepseek_v4 --experts
mxfp4|fp8`: V4-Flash's FP4 experts with FP8 linears in ue8m0 scales, V4-Flash-Base's FP8 experts and linears in F32
scales, the release's `.scale` names and `expert_dtype`; and FP8 experts in ue8m0 scales) against transformers 5.25
running their dequantized weights (fp32, CPU). The oracle's weights are decoded by transformers' own `Fp8Dequantize`
(int8 FP4 through its e2m1 table, e8m0 scales), not by strata: log-probabilities within 1e-4 and transformers' greedy
tokens, with every expert in memory and through the tiers (a store keeping the experts as the release ships them,
byte for byte; e8m0 FP8 scales converted to float32 exactly)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reference_models import read_tensors
from strata import Engine
from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat, ExpertLayout, dequantize_fp8
from strata.runtime.demo.deepseek_v4_quant import quantize_fp8_ue8m0
from strata.runtime.demo.model import write_demo_model
from strata.runtime.model.checkpoint import Checkpoint

ATOL = 1e-4
FP32 = {"dtype": "float32", "max_context": 256, "cpu_numerics": "gpu"}  # the CPU's experts in exact fp32 math
FORMATS = {"mxfp4": ExpertFormat("mxfp4"), "fp8": ExpertFormat("fp8", block=(32, 32)),
           "fp8-ue8m0": ExpertFormat("fp8", block=(32, 32))}


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """`dst`: `src`'s small files (config.json replaced by `config` when given) with `tensors` as its weights."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def dequantized_by_transformers(src: Path, dst: Path) -> Path:
    """`dst`: release `src` in fp32 under the same names, each `x.weight` + `x.scale` pair decoded by transformers'
    `Fp8Dequantize` (the `.scale` tensors, quantization_config and expert_dtype dropped)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    decode = Fp8Dequantize(None)
    tensors, out = read_tensors(src), {}
    for name, t in tensors.items():
        scale = name.removesuffix(".weight") + ".scale"
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in tensors:
            continue
        if name.endswith(".weight") and scale in tensors:
            out[name] = decode._dequantize_one(t, tensors[scale], torch.float32)
        else:
            out[name] = t.float() if t.is_floating_point() else t
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"], cfg["expert_dtype"]
    return rewrite(src, dst, out, cfg)


def with_ue8m0_scales(src: Path, dst: Path) -> Path:
    """`dst`: FP8 release `src` with every FP8 weight requantized to power-of-two scales stored F8_E8M0 (scale_fmt
    ue8m0), the routed experts' too: an FP8-expert release in V4-Flash's scale format."""
    tensors, out = read_tensors(src), {}
    cfg = json.loads((src / "config.json").read_text())
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    for name, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            scale = name.removesuffix(".weight") + ".scale"
            out[name], out[scale] = quantize_fp8_ue8m0(dequantize_fp8(t, tensors[scale], block), block)
        elif name not in out:
            out[name] = t
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    return rewrite(src, dst, out, cfg)


@pytest.fixture(scope="module", params=["mxfp4", "fp8", "fp8-ue8m0"])
def release(request, tmp_path_factory):
    """(experts, the tiny release, transformers' model of its dequantized weights)."""
    from transformers import AutoModelForCausalLM

    experts = request.param
    root = tmp_path_factory.mktemp(f"v4-{experts}")
    d = write_demo_model(root / "release", "tiny", arch="deepseek_v4", experts=experts.removesuffix("-ue8m0"),
                         progress=False)
    if experts == "fp8-ue8m0":
        d = with_ue8m0_scales(d, root / "ue8m0")
        assert read_tensors(d)["layers.2.ffn.experts.7.w1.scale"].dtype == torch.float8_e8m0fnu
    ref = AutoModelForCausalLM.from_pretrained(dequantized_by_transformers(d, root / "dequantized"),
                                               dtype=torch.float32).eval()
    return experts, d, ref


@pytest.mark.parametrize("experts", ["mxfp4", "fp8"])
def test_the_release_spelling_is_written(experts, tmp_path):
    d = write_demo_model(tmp_path / "release", "tiny", arch="deepseek_v4", experts=experts, progress=False)
    cfg, tensors = json.loads((d / "config.json").read_text()), read_tensors(d)
    q = cfg["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["weight_block_size"] == [32, 32]
    assert q.get("scale_fmt") == ("ue8m0" if experts == "mxfp4" else None)
    assert cfg["expert_dtype"] == ("fp4" if experts == "mxfp4" else "fp8")
    w1, s1 = tensors["layers.1.ffn.experts.5.w1.weight"], tensors["layers.1.ffn.experts.5.w1.scale"]
    if experts == "mxfp4":  # [I, H/2] two e2m1 a byte, [I, H/32] e8m0
        assert (w1.dtype, tuple(w1.shape), s1.dtype, tuple(s1.shape)) == (torch.int8, (32, 32), torch.float8_e8m0fnu,
                                                                           (32, 2))
    else:
        assert (w1.dtype, s1.dtype, tuple(s1.shape)) == (torch.float8_e4m3fn, torch.float32, (1, 2))
    scale_dtype = torch.float8_e8m0fnu if experts == "mxfp4" else torch.float32
    for name in ("layers.1.attn.wq_a", "layers.1.attn.wo_a", "layers.1.attn.indexer.wq_b", "layers.0.ffn.shared_experts.w2"):
        assert tensors[name + ".weight"].dtype == torch.float8_e4m3fn and tensors[name + ".scale"].dtype == scale_dtype
    for name in ("embed.weight", "head.weight", "layers.1.attn.compressor.wkv.weight", "layers.1.ffn.gate.weight",
                 "layers.1.attn.indexer.weights_proj.weight"):
        assert tensors[name].dtype == torch.bfloat16  # as the release keeps them
    assert tensors["layers.1.hc_attn_scale"].dtype == torch.float32  # a parameter named scale, not a quantization's


def test_loads_and_matches_transformers_on_its_dequantized_weights(release):
    experts, d, ref = release
    ckpt = Checkpoint.open(d)
    assert ckpt.expert_format == FORMATS[experts] and ckpt.expert_layout == "per-expert"
    prompt = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    memory = Engine.from_pretrained(d, device="cpu", config={"runtime": {**FP32, "experts": "memory"}})
    err = (memory.score(prompt) - expected).abs().max().item()
    assert err < ATOL, f"max |log p - ref| = {err:.2e}"
    tokens = memory.generate(prompt, max_tokens=12, temperature=0.0).token_ids
    with torch.no_grad():  # transformers' greedy tokens, by teacher forcing
        logits = ref(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == tokens
    cfg = {"runtime": FP32, "store": {"mode": "packed"}, "tiers": {"pinned": {"budget": "24KiB"}, "disk": {"scrub": False}}}
    with Engine.from_pretrained(d, device="cpu", config=cfg) as tiered:
        store = tiered.tiers.store
        assert store.expert_format == FORMATS[experts]
        assert (tiered.score(prompt) - expected).abs().max().item() < ATOL
        assert tiered.generate(prompt, max_tokens=12, temperature=0.0).token_ids == tokens
        assert tiered.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from disk
        check_blob_is_the_release_bytes(store, d, experts)
    cfg["runtime"] = {**FP32, "cpu_numerics": "fork"}  # the compiled kernel: the clipped form in it, bf16 products
    with Engine.from_pretrained(d, device="cpu", config=cfg) as forked:
        assert forked.plan.decode.startswith("experts on CPU threads from RAM, the compiled kernel")
        assert (forked.score(prompt) - expected).abs().max().item() < 3e-2
        assert forked.executor.cpu_experts > 0 and forked.executor.use_fast_cpu


def check_blob_is_the_release_bytes(store, d: Path, experts: str) -> None:
    """Expert (2, 7)'s blob holds the release's values and scales as shipped (gate rows, then up rows; down)."""
    tensors = read_tensors(d)
    gate_up, down = store.expert_matrices(store.read_expert((2, 7)))
    stem = "layers.2.ffn.experts.7."
    raw = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(raw(gate_up.values).reshape(-1), torch.cat([raw(tensors[stem + p + ".weight"]).reshape(-1)
                                                                    for p in ("w1", "w3")]))
    assert torch.equal(raw(down.values).reshape(-1), raw(tensors[stem + "w2.weight"]).reshape(-1))
    scales = torch.cat([tensors[stem + p + ".scale"] for p in ("w1", "w3")])
    if experts == "mxfp4":  # the e8m0 bytes themselves
        assert torch.equal(gate_up.scales.reshape(-1), raw(scales).reshape(-1))
    else:  # float32 blocks (e8m0 ones converted exactly)
        assert torch.equal(gate_up.scales.reshape(-1), scales.float().reshape(-1))


@pytest.mark.parametrize("experts", ["mxfp4", "fp8"])
def test_the_demo_holds_the_bf16_models_weights_rounded(experts, tmp_path):
    """Each routed expert is exactly what packing the bf16 demo model's expert into the format gives."""
    d = write_demo_model(tmp_path / "release", "tiny", arch="deepseek_v4", experts=experts, progress=False)
    plain = Checkpoint.open(write_demo_model(tmp_path / "bf16", "tiny", arch="deepseek_v4", progress=False))
    q = Checkpoint.open(d)
    layout = ExpertLayout.build(q.expert_format, 64, 32)
    gu_p, dn_p = plain.load_experts(1, torch.float32, "cpu")
    gu_q, dn_q = q.load_experts(1, torch.float32, "cpu")
    for e in (0, 11):
        want = layout.dequantize(layout.pack(gu_p[e], dn_p[e]), torch.float32)
        assert torch.equal(gu_q[e], want[0]) and torch.equal(dn_q[e], want[1])
    assert not torch.equal(gu_q[0], gu_p[0])  # rounded: the format's values, not the bf16 ones


def test_what_cannot_be_read_is_named(tmp_path):
    d = write_demo_model(tmp_path / "release", "tiny", arch="deepseek_v4", experts="mxfp4", progress=False)
    tensors = read_tensors(d)
    scale = "layers.1.ffn.experts.3.w2.scale"

    def broken(name: str, change: dict) -> Path:
        return rewrite(d, tmp_path / name, {**{k: v for k, v in tensors.items() if k not in change}, **{
            k: v for k, v in change.items() if v is not None}})

    with pytest.raises(CheckpointError, match=rf"'{scale}' is F32 \[64, 1\] but FP4 .* needs F8_E8M0 \[64, 1\]"):
        Checkpoint.open(broken("f32-scales", {scale: tensors[scale].float()}))
    with pytest.raises(CheckpointError, match=r"FP4 tensor 'layers.1.ffn.experts.3.w2.weight' .* has no "
                                              r"'layers.1.ffn.experts.3.w2.scale'"):
        Checkpoint.open(broken("no-scale", {scale: None}))
    with pytest.raises(CheckpointError, match=r"FP8 tensor 'layers.1.attn.wq_a.weight' has no "
                                              r"'layers.1.attn.wq_a.scale'"):
        Checkpoint.open(broken("no-fp8-scale", {"layers.1.attn.wq_a.scale": None}))
    with pytest.raises(CheckpointError, match=r"'layers.1.attn.wq_a.weight' is FP4 \(I8\); strata reads FP4 in "
                                              r"the routed experts only"):
        Checkpoint.open(broken("fp4-attention", {"layers.1.attn.wq_a.weight": torch.zeros(32, 32, dtype=torch.int8),
                                                 "layers.1.attn.wq_a.scale": torch.zeros(32, 2).to(torch.float8_e8m0fnu)}))
    with pytest.raises(CheckpointError, match=r"'layers.1.attn.wq_a.scale' is I32; the FP8 block scales of "
                                              r"'layers.1.attn.wq_a.weight' are F8_E8M0 or F32"):
        Checkpoint.open(broken("int-scales", {"layers.1.attn.wq_a.scale": torch.ones(1, 2, dtype=torch.int32)}))


def test_fp4_experts_stored_as_u8_read_as_i8(tmp_path):
    """A re-pack storing the FP4 experts' bytes as U8 instead of I8 reads as the release does."""
    d = write_demo_model(tmp_path / "release", "tiny", arch="deepseek_v4", experts="mxfp4", progress=False)
    tensors = read_tensors(d)
    u8 = rewrite(d, tmp_path / "u8", {k: t.view(torch.uint8) if t.dtype == torch.int8 else t for k, t in tensors.items()})
    assert read_tensors(u8)["layers.1.ffn.experts.3.w1.weight"].dtype == torch.uint8
    release, repack = Checkpoint.open(d), Checkpoint.open(u8)
    assert repack.expert_format == ExpertFormat("mxfp4")
    for a, b in zip(release.load_experts(1, torch.float32, "cpu"), repack.load_experts(1, torch.float32, "cpu"),
                    strict=True):
        assert torch.equal(a, b)

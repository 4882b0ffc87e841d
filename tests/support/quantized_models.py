"""Quantized checkpoints as model makers ship them, written from the tiny reference checkpoints, and their oracles.

`quantize_checkpoint` rewrites a checkpoint's weights: block-scaled FP8 (`...weight` F8_E4M3 + `...weight_scale_inv`
F32 for every linear weight but the embeddings, lm_head and routers, with `quantization_config` {quant_method "fp8",
weight_block_size}, as DeepSeek-V3 ships) or MXFP4 (the fused routed experts as gpt-oss ships them,
`experts.gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32]). `dequantized_checkpoint` writes the
fp32 checkpoint of the very weights those decode to, which transformers loads as the oracle.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from reference_models import read_tensors
from strata.kernels.quant import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4

_KEEP = re.compile(r"(embed_tokens|lm_head|norm|\.gate\.weight|shared_expert_gate\.weight)")  # stay in their dtype
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _copy_small_files(src: Path, dst: Path, quantization: dict | None) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization is not None:
        cfg["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(cfg))


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (values F8 [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)]), matrix by matrix."""
    if w.dim() == 2:
        return quantize_fp8(w, block)
    parts = [quantize_fp8(m, block) for m in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def quantize_checkpoint(src: Path, dst: Path, fmt: str, block: tuple[int, int] = (16, 16)) -> Path:
    """Write `dst`: `src` with its weights quantized to `fmt` ("fp8" or "mxfp4"), laid out as released checkpoints."""
    out: dict[str, torch.Tensor] = {}
    for name, w in read_tensors(src).items():
        fused = _FUSED.search(name)
        if fmt == "mxfp4" and fused:  # [E, N, K] -> blocks [E, N, K/32, 16], scales [E, N, K/32]
            parts = [quantize_mxfp4(m.float()) for m in w]
            e, n, k = w.shape
            out[name + "_blocks"] = torch.stack([q for q, _ in parts]).reshape(e, n, k // 32, 16)
            out[name + "_scales"] = torch.stack([s for _, s in parts])
        elif fmt == "fp8" and w.dim() >= 2 and (name.endswith(".weight") or fused) and not _KEEP.search(name):
            q, s = _fp8(w.float(), block)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = w
    quantization = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": list(block)} if fmt == "fp8" else {"quant_method": "mxfp4"})
    _copy_small_files(src, dst, quantization)
    save_file(out, dst / "model.safetensors")
    return dst


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """Write `dst`: the fp32 checkpoint of the weights quantized checkpoint `src` decodes to (no quantization_config)."""
    cfg = json.loads((src / "config.json").read_text())
    block = tuple(cfg["quantization_config"].get("weight_block_size") or (128, 128))
    tensors = read_tensors(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("_scale_inv", "_scales")):
            continue
        if name.endswith("_blocks"):
            scales = tensors[name.removesuffix("_blocks") + "_scales"]
            out[name.removesuffix("_blocks")] = torch.stack([dequantize_mxfp4(b, s) for b, s in zip(t, scales, strict=True)])
        elif t.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"]
            out[name] = (dequantize_fp8(t, s, block) if t.dim() == 2
                         else torch.stack([dequantize_fp8(m, ms, block) for m, ms in zip(t, s, strict=True)]))
        else:
            out[name] = t.float()
    _copy_small_files(src, dst, None)
    save_file(out, dst / "model.safetensors")
    return dst


def oracle(directory: Path):
    """transformers' model of checkpoint `directory` in fp32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def set_tensor(directory: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (or, with None, remove) one tensor of `directory`'s model.safetensors."""
    tensors = read_tensors(directory)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, directory / "model.safetensors")


def build_wide(directory: Path, seed: int = 0) -> Path:
    """A qwen3_moe checkpoint wide enough for DeepSeek-V3's real 128 x 128 FP8 blocks (hidden and expert width 128),
    in the fused layout, fp32."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from reference_models import VOCAB, write_tokenizer

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=128,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(directory, save_original_format=False)
    write_tokenizer(directory)
    return directory

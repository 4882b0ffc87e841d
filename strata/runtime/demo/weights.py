"""The demo model's tensors: names and shapes per architecture, deterministic values, safetensors headers.

Names follow the checkpoints as they ship on the Hub: one tensor per expert projection
(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`), which transformers fuses on load into
`mlp.experts.gate_up_proj` [E, 2*I, H] and `mlp.experts.down_proj` [E, H, I]. The DeepSeek router's
`e_score_correction_bias` is F32, as in DeepSeek-V3's checkpoint (transformers keeps it in fp32).
"""

from __future__ import annotations

import math
import os
import re
import zlib
from dataclasses import dataclass

import torch

from strata.tiers.store.files import pwrite_all
from strata.tiers.store.safetensors_header import encode_header

# the dtypes demo tensors are written in: generated ones in BF16 / F32; quantized releases' FP8 values and MXFP4 bytes
_DTYPES = {"BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4), "F8_E4M3": (torch.float8_e4m3fn, 1),
           "U8": (torch.uint8, 1)}


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, shape, safetensors dtype and how it is initialised."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "BF16"
    init: str = "normal"  # "normal": N(0, initializer_range); "ones": RMSNorm weights

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES or not (self.init in ("normal", "ones") or self.init.startswith("token_map:")):
            raise ValueError(f"bad TensorSpec {self}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype][1]


def tensor_specs(cfg: dict) -> list[TensorSpec]:
    """Every tensor of a demo config.json dict, in checkpoint order (embeddings, layers, norm, lm_head)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (v, h))]
    layer_fn = {"deepseek_v3": _deepseek_layer, "deepseek_v2": _deepseek_layer, "qwen3_moe": _qwen3_moe_layer,
                "glm4_moe": _glm4_moe_layer, "minimax_m2": _minimax_m2_layer}[cfg["model_type"]]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), init="ones"))
        specs.extend(layer_fn(cfg, i, p))
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), init="ones"))
    specs.append(TensorSpec("model.norm.weight", (h,), init="ones"))
    if cfg.get("engram"):
        from strata.runtime.demo.engram import engram_specs

        specs.extend(engram_specs(cfg, TensorSpec))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (v, h)))
    return specs


def _mlp(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    """A SwiGLU MLP: gate/up [I, H], down [H, I]."""
    return [
        TensorSpec(prefix + "gate_proj.weight", (inter, hidden)),
        TensorSpec(prefix + "up_proj.weight", (inter, hidden)),
        TensorSpec(prefix + "down_proj.weight", (hidden, inter)),
    ]


def _experts(p: str, hidden: int, inter: int, n: int) -> list[TensorSpec]:
    return [t for e in range(n) for t in _mlp(f"{p}mlp.experts.{e}.", hidden, inter)]


def _deepseek_layer(cfg: dict, i: int, p: str) -> list[TensorSpec]:
    """DeepSeek-V3 (and V2, whose softmax router has no correction bias): MLA attention, then a dense MLP
    (first_k_dense_replace layers) or a MoE."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    a = p + "self_attn."
    if qr is None:
        out = [TensorSpec(a + "q_proj.weight", (nh * (nope + rope), h))]
    else:  # low-rank q: H -> q_lora_rank -> heads * (nope + rope)
        out = [
            TensorSpec(a + "q_a_proj.weight", (qr, h)),
            TensorSpec(a + "q_a_layernorm.weight", (qr,), init="ones"),
            TensorSpec(a + "q_b_proj.weight", (nh * (nope + rope), qr)),
        ]
    out += [
        TensorSpec(a + "kv_a_proj_with_mqa.weight", (kvr + rope, h)),  # compressed kv + shared rope key
        TensorSpec(a + "kv_a_layernorm.weight", (kvr,), init="ones"),
        TensorSpec(a + "kv_b_proj.weight", (nh * (nope + vd), kvr)),
        TensorSpec(a + "o_proj.weight", (h, nh * vd)),
    ]
    if i < cfg["first_k_dense_replace"]:
        return out + _mlp(p + "mlp.", h, cfg["intermediate_size"])
    e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out.append(TensorSpec(p + "mlp.gate.weight", (e, h)))
    if cfg["model_type"] != "deepseek_v2":
        out.append(TensorSpec(p + "mlp.gate.e_score_correction_bias", (e,), dtype="F32"))
    out += _mlp(p + "mlp.shared_experts.", h, mi * cfg["n_shared_experts"])
    return out + _experts(p, h, mi, e)


def _glm4_moe_layer(cfg: dict, i: int, p: str) -> list[TensorSpec]:
    """GLM-4.5: GQA attention with q/k/v biases (attention_bias) and optional per-head q/k RMSNorm (use_qk_norm),
    then a dense MLP (first_k_dense_replace layers) or DeepSeek-V3's MoE (router, correction bias, shared experts)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    a = p + "self_attn."
    out = [
        TensorSpec(a + "q_proj.weight", (nh * hd, h)),
        TensorSpec(a + "k_proj.weight", (nkv * hd, h)),
        TensorSpec(a + "v_proj.weight", (nkv * hd, h)),
        TensorSpec(a + "o_proj.weight", (h, nh * hd)),
    ]
    if cfg["attention_bias"]:
        out += [TensorSpec(a + f"{x}_proj.bias", (n * hd,)) for x, n in (("q", nh), ("k", nkv), ("v", nkv))]
    if cfg["use_qk_norm"]:
        out += [TensorSpec(a + "q_norm.weight", (hd,), init="ones"), TensorSpec(a + "k_norm.weight", (hd,), init="ones")]
    if i < cfg["first_k_dense_replace"]:
        return out + _mlp(p + "mlp.", h, cfg["intermediate_size"])
    e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out += [
        TensorSpec(p + "mlp.gate.weight", (e, h)),
        TensorSpec(p + "mlp.gate.e_score_correction_bias", (e,), dtype="F32"),
    ]
    out += _mlp(p + "mlp.shared_experts.", h, mi * cfg["n_shared_experts"])
    return out + _experts(p, h, mi, e)


def _minimax_m2_layer(cfg: dict, i: int, p: str) -> list[TensorSpec]:
    """MiniMax-M2, under its release's names: GQA attention with q/k RMSNorm over the whole projection, then a MoE
    (`block_sparse_moe`: router, the correction bias beside it in F32, experts as Mixtral's w1 / w3 / w2)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, mi = cfg["num_local_experts"], cfg["intermediate_size"]
    a, m = p + "self_attn.", p + "block_sparse_moe."
    out = [
        TensorSpec(a + "q_proj.weight", (nh * hd, h)),
        TensorSpec(a + "k_proj.weight", (nkv * hd, h)),
        TensorSpec(a + "v_proj.weight", (nkv * hd, h)),
        TensorSpec(a + "o_proj.weight", (h, nh * hd)),
        TensorSpec(a + "q_norm.weight", (nh * hd,), init="ones"),
        TensorSpec(a + "k_norm.weight", (nkv * hd,), init="ones"),
        TensorSpec(m + "gate.weight", (e, h)),
        TensorSpec(m + "e_score_correction_bias", (e,), dtype="F32"),
    ]
    shapes = {"w1": (mi, h), "w3": (mi, h), "w2": (h, mi)}
    return out + [TensorSpec(f"{m}experts.{x}.{w}.weight", shape) for x in range(e) for w, shape in shapes.items()]


def _qwen3_moe_layer(cfg: dict, i: int, p: str) -> list[TensorSpec]:
    """Qwen3-MoE: GQA attention with per-head q/k RMSNorm, then a MoE (or a dense MLP in mlp_only_layers)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    a = p + "self_attn."
    out = [
        TensorSpec(a + "q_proj.weight", (nh * hd, h)),
        TensorSpec(a + "k_proj.weight", (nkv * hd, h)),
        TensorSpec(a + "v_proj.weight", (nkv * hd, h)),
        TensorSpec(a + "o_proj.weight", (h, nh * hd)),
        TensorSpec(a + "q_norm.weight", (hd,), init="ones"),
        TensorSpec(a + "k_norm.weight", (hd,), init="ones"),
    ]
    sparse = i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0
    if not sparse:
        return out + _mlp(p + "mlp.", h, cfg["intermediate_size"])
    e = cfg["num_experts"]
    return out + [TensorSpec(p + "mlp.gate.weight", (e, h))] + _experts(p, h, cfg["moe_intermediate_size"], e)


# --- deterministic values -------------------------------------------------------------------------
# torch's CPU generator (mt19937) only uses the low 32 bits of a seed, and a 32-bit hash of ~19k
# tensor names would collide with a few percent probability (two identical experts). So a tensor's
# seed is an injective 32-bit id built from its name (layer, expert, kind), offset by a hash of the
# user seed: distinct tensors of one model always get distinct streams.
_KINDS: tuple[str, ...] = (
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",  # under mlp.experts.E.
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",  # (GLM-4.5; 31 of the 32 ids)
)  # fmt: skip
_KIND_IDS = {k: i for i, k in enumerate(_KINDS)}
_NAME_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?(.+)")


def tensor_seed(seed: int, name: str) -> int:
    """The 32-bit generator seed of tensor `name`: depends only on (seed, name), unique within a model."""
    m = _NAME_RE.fullmatch(_transformers_name(name))
    layer, expert, kind = (int(m[1]) + 1, int(m[2]) + 1 if m[2] else 0, m[3]) if m else (0, 0, name)
    if kind.startswith(("engram.", "model.engram.")) and not expert:  # Engram tensors: a reserved expert id keeps the ids distinct
        from strata.runtime.demo.engram import ENGRAM_KINDS

        expert, kind = (1 << 16) - 1, _KINDS[ENGRAM_KINDS.index(kind)] if kind in ENGRAM_KINDS else kind
    if kind not in _KIND_IDS or layer >= 1 << 11 or expert >= 1 << 16:
        raise ValueError(f"no deterministic seed for tensor name {name!r}")
    uid = (layer << 21) | (expert << 5) | _KIND_IDS[kind]  # 11 + 16 + 5 bits
    return (zlib.crc32(f"strata-demo:{seed}".encode()) + uid) & 0xFFFFFFFF


def _transformers_name(name: str) -> str:
    """A release's name as the transformers name whose seed it takes: MiniMax-M2's Mixtral-style experts
    (`block_sparse_moe.experts.E.w1` -> `mlp.experts.E.gate_proj`, w3 up, w2 down) and router."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.w([123])\.weight$", lambda w: f".{('gate', 'down', 'up')[int(w[1]) - 1]}_proj.weight", name)


def make_tensor(spec: TensorSpec, seed: int, std: float) -> torch.Tensor:
    """The tensor's values: ones for norms, else N(0, std) from the tensor's own generator.

    `normal_` computes `std * z` in fp32 and rounds once into the bf16 storage: no fp32 temporary,
    ~2x the throughput of `randn(...).mul_(std).to(bf16)`.
    """
    dtype = _DTYPES[spec.dtype][0]
    if spec.init.startswith("token_map:"):  # Engram's normalisation table, from the demo tokenizer
        from strata.runtime.demo.engram import demo_token_map

        return demo_token_map(int(spec.init.split(":")[1]), spec.shape[0]).to(dtype)
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    return torch.empty(spec.shape, dtype=dtype).normal_(0.0, std, generator=g)


def write_safetensors_header(fd: int, specs: list[TensorSpec]) -> list[int]:
    """Write a safetensors header for `specs` (data in that order) at the start of `fd` and size the file.

    Returns each tensor's absolute byte offset. The file is extended to its final size (sparse until
    the data is written), so tensors can then be pwritten in any order.
    """
    head = encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in specs])  # data 8-byte aligned
    pwrite_all(fd, head, 0)
    os.ftruncate(fd, len(head) + sum(t.nbytes for t in specs))
    starts, pos = [], len(head)
    for t in specs:
        starts.append(pos)
        pos += t.nbytes
    return starts

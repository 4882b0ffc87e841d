"""`strata demo-model --arch qwen3_5_moe`: random-weight Qwen3.5-MoE checkpoints, as transformers'
`Qwen3_5MoeForCausalLM` holds the releases' language model (`qwen3_5_moe_text`, tensors under `model.`, the routed
experts fused 3-D as the releases ship them: gate_up_proj [E, 2I, H], down_proj [E, H, I]); transformers and strata
load them alike. Every size has the releases' hybrid schedule (three Gated DeltaNet layers, then one gated
full-attention layer), partial rotary (a quarter of each head) and a shared expert in every layer:

- `tiny`: 4 layers x 16 experts, hidden 64, ~1 MB, for tests.
- `small`: 8 layers x 64 experts of 256, hidden 512, head_dim 128 (2 KV heads), linear heads 4 keys / 8 values of
  64, ~450 MB: the CPU benchmark's model (bench/linear_attention_decode.py).
- `bench`: Qwen3.5-35B-A3B's configuration (its text_config): 40 layers x 256 experts of 512, hidden 2048, head_dim
  256 (16 heads, 2 KV heads), linear heads 16 keys / 32 values of 128, ~1.6 GB of experts a layer, ~69 GB in all
  (`--layers N` writes fewer). The 397B-A17B release has the same layer shapes at a larger scale; 35B-A3B is the
  one a single host runs whole, as the other archs' bench sizes.

Weights are N(0, initializer_range) from one generator per tensor (per expert slice of the fused tensors), seeded
by (seed, the tensor's position, the slice): the bytes do not depend on write order or threading. Norm weights are
transformers' initial values (zero-centred norms 0, the gated norm 1), dt_bias 1 and A_log log(U(0.01, 16)), as
transformers initialises them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from strata.errors import ConfigError
from strata.runtime.demo.shards import DemoTensor, demo_layers, write_demo_files, write_shards

ARCH = "qwen3_5_moe"
LIN, FULL = "linear_attention", "full_attention"
_COMMON = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "hidden_act": "silu",
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0,
    "linear_conv_kernel_dim": 4, "tie_word_embeddings": False, "use_cache": True, "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip
CONFIGS: dict[str, dict] = {
    "tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
             "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 4096,
             "rope_theta": 10000.0},
    "small": {**_COMMON, "vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
              "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8,
              "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "max_position_embeddings": 32768,
              "rope_theta": 10000000.0},
    "bench": {**_COMMON, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8,
              "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144,
              "rope_theta": 10000000.0},
}  # fmt: skip



def q35_config(size: str, layers: int | None = None) -> dict:
    """config.json of a Qwen3.5-MoE demo model of `size`, with `layers` layers (None: the size's)."""
    if size not in CONFIGS:
        raise ConfigError(f"unknown demo model size {size!r} for --arch {ARCH}; use one of {', '.join(CONFIGS)}")
    cfg = dict(CONFIGS[size])
    n = demo_layers(cfg["num_hidden_layers"], layers)
    cfg["num_hidden_layers"] = n
    cfg["layer_types"] = [LIN if (i + 1) % 4 else FULL for i in range(n)]  # the releases' full_attention_interval 4
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                              "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    cfg["bos_token_id"], cfg["eos_token_id"] = 0, 2  # the demo tokenizer's <|endoftext|> and <|im_end|>
    cfg["dtype"] = "bfloat16"
    return dict(sorted(cfg.items()))


def q35_tensors(cfg: dict) -> list[DemoTensor]:
    """Every tensor of a Qwen3.5-MoE demo config, in checkpoint order, under transformers' names."""
    h, v, nh, kv, d = (cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                        "head_dim"))
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, value_dim = hk * cfg["linear_key_head_dim"], hv * cfg["linear_value_head_dim"]
    conv = 2 * key_dim + value_dim
    e, mi, si = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    T = DemoTensor
    out = [T("model.embed_tokens.weight", (v, h))]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        out += [T(p + "input_layernorm.weight", (h,), init="zeros"),
                T(p + "post_attention_layernorm.weight", (h,), init="zeros")]
        if kind == LIN:
            a = p + "linear_attn."
            out += [T(a + "in_proj_qkv.weight", (conv, h)), T(a + "in_proj_z.weight", (value_dim, h)),
                    T(a + "in_proj_b.weight", (hv, h)), T(a + "in_proj_a.weight", (hv, h)),
                    T(a + "conv1d.weight", (conv, 1, cfg["linear_conv_kernel_dim"])),
                    T(a + "dt_bias", (hv,), init="ones"), T(a + "A_log", (hv,), init="a_log"),
                    T(a + "norm.weight", (cfg["linear_value_head_dim"],), init="ones"),
                    T(a + "out_proj.weight", (h, value_dim))]
        else:
            a = p + "self_attn."
            out += [T(a + "q_proj.weight", (2 * nh * d, h)), T(a + "k_proj.weight", (kv * d, h)),
                    T(a + "v_proj.weight", (kv * d, h)), T(a + "o_proj.weight", (h, nh * d)),
                    T(a + "q_norm.weight", (d,), init="zeros"), T(a + "k_norm.weight", (d,), init="zeros")]
        m = p + "mlp."
        out += [T(m + "gate.weight", (e, h)), T(m + "experts.gate_up_proj", (e, 2 * mi, h)),
                T(m + "experts.down_proj", (e, h, mi)), T(m + "shared_expert.gate_proj.weight", (si, h)),
                T(m + "shared_expert.up_proj.weight", (si, h)), T(m + "shared_expert.down_proj.weight", (h, si)),
                T(m + "shared_expert_gate.weight", (1, h))]
    out += [T("model.norm.weight", (h,), init="zeros"), T("lm_head.weight", (v, h))]
    return out


def make_q35_slice(t: DemoTensor, index: int, part: int, seed: int, std: float) -> torch.Tensor:
    """Slice `part` of tensor `t` (the `index`-th of the checkpoint): the whole tensor, or one expert's slice of a
    fused 3-D one, from its own generator, seeded injectively by (seed, index, part)."""
    dtype = t.torch_dtype
    shape = t.shape[1:] if len(t.shape) == 3 else t.shape
    if t.init in ("ones", "zeros"):
        return (torch.ones if t.init == "ones" else torch.zeros)(shape, dtype=dtype)
    gen = torch.Generator().manual_seed((zlib.crc32(f"strata-demo-q35:{seed}:{index}".encode()) + part) & 0xFFFFFFFF)
    if t.init == "a_log":  # log A, A ~ U(0.01, 16) as transformers initialises it
        return torch.empty(shape).uniform_(0.01, 16, generator=gen).log().to(dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=gen)


def q35_demo(size: str, layers: int | None, seed: int, max_shard_bytes: int, progress: bool, workers: int | None
             ) -> tuple[dict, Callable[[Path], None]]:
    """(the marker identifying the model, a function writing every file but the marker into a directory)."""
    cfg = q35_config(size, layers)
    marker = {"strata_demo": 1, "arch": ARCH, "size": size, "num_hidden_layers": cfg["num_hidden_layers"], "seed": seed}

    def weights(tmp: Path) -> None:
        write_q35_weights(tmp, cfg, seed, max_shard_bytes, progress, workers)

    return marker, lambda tmp: write_demo_files(tmp, size, cfg, weights)


def write_q35_weights(tmp: Path, cfg: dict, seed: int, max_shard_bytes: int, progress: bool,
                      workers: int | None) -> None:
    """The safetensors shard(s) of `cfg` (and model.safetensors.index.json when there are several), into `tmp`."""
    write_shards(tmp, q35_tensors(cfg), lambda t, i, part: make_q35_slice(t, i, part, seed, cfg["initializer_range"]),
                 max_shard_bytes, progress, workers, f"demo-{ARCH}",
                 parts=lambda t: t.shape[0] if len(t.shape) == 3 else 1)

"""`strata demo-model --arch gpt_oss`: random-weight gpt-oss checkpoints, laid out as the release ships them.

Tensor names are the release's (transformers' `GptOssForCausalLM`: `model.layers.L.self_attn.sinks`, `mlp.router.
{weight,bias}`, `mlp.experts.gate_up_proj_blocks` ...), every non-expert weight in BF16. The routed experts are MXFP4
as released (`experts="mxfp4"`, the CLI's default for this architecture: `*_blocks` [E, N, K/32, 16] U8 + `*_scales`
[E, N, K/32] U8, gate_up's rows interleaving gate and up, with `quantization_config` {"quant_method": "mxfp4"}) or,
with `experts="bf16"`, transformers' own bf16 parameters (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]); the
expert biases are BF16 either way. Every size has the release's schedule (sliding-window and full attention
alternating, a 128-token window but tiny's 32), q/k/v/o biases, YaRN x32 over 4,096 positions (theta 150,000) and
the clamped SwiGLU (alpha 1.702, limit 7.0):

- `tiny`: 4 layers x 16 experts of 64, hidden 64, for tests.
- `small`: 8 layers x 32 experts of 512, hidden 512, 8 heads of 64 (2 KV heads), ~13 MiB of MXFP4 experts a
  layer, ~130 MiB in all (~400 MiB in bf16).
- `bench`: gpt-oss-120b's configuration: 36 layers x 128 experts of 2880, hidden 2880, 64 heads of 64 (8 KV heads),
  vocabulary 201,088, top 4, ~1.6 GiB of MXFP4 experts a layer, ~61 GiB in all (~218 GiB in bf16; `--layers N`
  writes fewer).

Values come from one generator per tensor (per expert slice of the fused expert tensors), seeded by (seed, the
tensor's position, the slice): the bytes do not depend on write order or threading. Weights and biases are
N(0, initializer_range), norms 1; MXFP4 experts are random E2M1 codes under e8m0 scales of 2^-8 or 2^-7 (about
the spread N(0, 0.02) weights quantize to), so writing the bench size costs no quantizing.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from strata.errors import ConfigError
from strata.kernels.quant import MX_GROUP
from strata.runtime.demo.shards import DemoTensor, demo_layers, write_demo_files, write_shards

ARCH = "gpt_oss"
EXPERTS = ("mxfp4", "bf16")  # the release's format, or transformers' bf16 parameters
_COMMON = {
    "architectures": ["GptOssForCausalLM"], "model_type": ARCH, "attention_bias": True, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
    "max_position_embeddings": 131072, "rope_theta": 150000.0, "tie_word_embeddings": False, "use_cache": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
}  # fmt: skip
CONFIGS: dict[str, dict] = {
    "tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 16,
             "num_experts_per_tok": 4, "sliding_window": 32},
    "small": {**_COMMON, "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 32,
              "num_experts_per_tok": 4, "sliding_window": 128},
    "bench": {**_COMMON, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
              "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
              "num_experts_per_tok": 4, "sliding_window": 128},
}  # fmt: skip
_MX_SCALES = (119, 120)  # e8m0 exponents of the random MXFP4 experts' groups: 2^-8, 2^-7



def oss_config(size: str, layers: int | None = None, experts: str = "mxfp4") -> dict:
    """config.json of a gpt-oss demo model of `size`, with `layers` layers (None: the size's), experts in `experts`."""
    if size not in CONFIGS:
        raise ConfigError(f"unknown demo model size {size!r} for --arch {ARCH}; use one of {', '.join(CONFIGS)}")
    if experts not in EXPERTS:
        raise ConfigError(f"--experts {experts}: gpt-oss ships its experts in MXFP4; write them as mxfp4 (the "
                          "release) or bf16 (transformers' bf16 parameters)")
    cfg = dict(CONFIGS[size])
    n = demo_layers(cfg["num_hidden_layers"], layers)
    cfg["num_hidden_layers"] = n
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    cfg["bos_token_id"], cfg["eos_token_id"] = 0, 2  # the demo tokenizer's <|endoftext|> and <|im_end|>
    cfg["dtype"] = "bfloat16"
    if experts == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return dict(sorted(cfg.items()))


def oss_tensors(cfg: dict) -> list[DemoTensor]:
    """Every tensor of a gpt-oss demo config, in checkpoint order, under the release's names."""
    h, v, nh, kv, d = (cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                       cfg["head_dim"])
    e, i = cfg["num_local_experts"], cfg["intermediate_size"]
    mxfp4 = "quantization_config" in cfg
    T = DemoTensor
    out = [T("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p, a, m = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        out += [T(p + "input_layernorm.weight", (h,), init="ones"),
                T(p + "post_attention_layernorm.weight", (h,), init="ones")]
        for proj, rows, cols in (("q_proj", nh * d, h), ("k_proj", kv * d, h), ("v_proj", kv * d, h),
                                 ("o_proj", h, nh * d)):
            out += [T(f"{a}{proj}.weight", (rows, cols)), T(f"{a}{proj}.bias", (rows,))]
        out += [T(a + "sinks", (nh,)), T(m + "router.weight", (e, h)), T(m + "router.bias", (e,))]
        x = m + "experts."
        if mxfp4:  # the release's blocks and scales: rows [2I] of K = H, rows [H] of K = I
            for proj, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                out += [T(f"{x}{proj}_blocks", (e, rows, k // MX_GROUP, MX_GROUP // 2), "U8", "codes", True),
                        T(f"{x}{proj}_scales", (e, rows, k // MX_GROUP), "U8", "scales", True)]
        else:  # transformers' parameters: gate_up [E, H, 2I], down [E, I, H]
            out += [T(x + "gate_up_proj", (e, h, 2 * i), per_expert=True), T(x + "down_proj", (e, i, h), per_expert=True)]
        out += [T(x + "gate_up_proj_bias", (e, 2 * i)), T(x + "down_proj_bias", (e, h))]
    return out + [T("model.norm.weight", (h,), init="ones"), T("lm_head.weight", (v, h))]


def make_oss_slice(t: DemoTensor, index: int, part: int, seed: int, std: float) -> torch.Tensor:
    """Slice `part` of tensor `t` (the `index`-th of the checkpoint): the whole tensor, or expert `part`'s slice of a
    `per_expert` one; its own generator, seeded injectively by (seed, index, part)."""
    shape = t.shape[1:] if t.per_expert else t.shape
    dtype = t.torch_dtype
    if t.init == "ones":
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed((zlib.crc32(f"strata-demo-gpt-oss:{seed}:{index}".encode()) + part) & 0xFFFFFFFF)
    if t.init == "codes":  # two random E2M1 codes a byte
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if t.init == "scales":
        lo, hi = _MX_SCALES
        return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, generator=gen)
    return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=gen)


def oss_demo(size: str, layers: int | None, seed: int, max_shard_bytes: int, progress: bool, workers: int | None,
             experts: str = "mxfp4") -> tuple[dict, Callable[[Path], None]]:
    """(the marker identifying the model, a function writing every file but the marker into a directory)."""
    cfg = oss_config(size, layers, experts)
    marker = {"strata_demo": 1, "arch": ARCH, "size": size, "num_hidden_layers": cfg["num_hidden_layers"],
              "seed": seed, "experts": experts}

    def weights(tmp: Path) -> None:
        write_oss_weights(tmp, cfg, seed, max_shard_bytes, progress, workers)

    return marker, lambda tmp: write_demo_files(tmp, size, cfg, weights)


def write_oss_weights(tmp: Path, cfg: dict, seed: int, max_shard_bytes: int, progress: bool,
                      workers: int | None) -> None:
    """The safetensors shard(s) of `cfg` (and model.safetensors.index.json when there are several), into `tmp`."""
    write_shards(tmp, oss_tensors(cfg), lambda t, i, part: make_oss_slice(t, i, part, seed, cfg["initializer_range"]),
                 max_shard_bytes, progress, workers, f"demo-{ARCH}",
                 parts=lambda t: t.shape[0] if t.per_expert else 1, order_in_shard=lambda t: -t.torch_dtype.itemsize)

"""`strata demo-model --arch deepseek_v4`: random-weight DeepSeek-V4 checkpoints, laid out as the release ships them.

Tensor names are the original release's (`embed.weight`, `layers.L.attn.wq_a.weight`, `layers.L.ffn.experts.E.w1
.weight`, `hc_head_fn`, ...: strata.runtime.model.deepseek_v4.names reads them, as transformers' conversion mapping
does), one tensor per expert projection, bf16 weights with transformers' fp32 ones (hyper-connections, norms, sinks,
compressor biases, the routers' correction bias) in F32 and each hash layer's tid2eid table in I32 (distinct random
experts per token). Sizes (every one with the architecture's 1M-token context, CSA every 4 and HCA every 128 tokens,
4 hyper-connection streams, 20 Sinkhorn iterations, YaRN on the compressed branches):

- `tiny`: 4 layers (sliding window, CSA, HCA, CSA) x 16 experts, hidden 64, ~1.3 MB, for tests.
- `small`: 8 layers (V4's HCA / CSA schedule) x 64 experts of 256, hidden 512, head_dim 128, ~440 MB.
- `bench`: DeepSeek-V4-Flash's configuration (transformers' DeepseekV4Config defaults): 43 layers x 256 experts of
  2048, hidden 4096, head_dim 512, 64 heads, ~13 GB of experts a layer (`--layers N` writes fewer).

Values are N(0, initializer_range) from one generator per tensor, seeded by (seed, the tensor's position in the
checkpoint): the bytes do not depend on write order or threading.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from strata.errors import ConfigError
from strata.runtime.demo.shards import DemoTensor, demo_layers, write_demo_files, write_shards

ARCH = "deepseek_v4"
HCA, CSA, SLIDING = "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"
_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": ARCH, "hidden_act": "silu", "initializer_range": 0.02,
    "rms_norm_eps": 1e-6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "n_shared_experts": 1, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "compress_rates": {CSA: 4, HCA: 128}, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_key_value_heads": 1, "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False, "attention_bias": False, "use_cache": True,
}  # fmt: skip
CONFIGS: dict[str, dict] = {
    "tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
             "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
             "n_routed_experts": 16, "num_experts_per_tok": 4, "o_groups": 2, "o_lora_rank": 16,
             "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, "sliding_window": 32, "num_hash_layers": 1,
             "layer_types": [SLIDING, CSA, HCA, CSA]},
    "small": {**_COMMON, "vocab_size": 8192, "hidden_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 8,
              "num_attention_heads": 8, "head_dim": 128, "q_lora_rank": 256, "qk_rope_head_dim": 16,
              "n_routed_experts": 64, "num_experts_per_tok": 6, "o_groups": 4, "o_lora_rank": 256,
              "index_n_heads": 16, "index_head_dim": 64, "index_topk": 128, "sliding_window": 128,
              "num_hash_layers": 3},
    "bench": {**_COMMON, "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
              "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024,
              "qk_rope_head_dim": 64, "n_routed_experts": 256, "num_experts_per_tok": 6, "o_groups": 8,
              "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
              "sliding_window": 128, "num_hash_layers": 3},
}  # fmt: skip



def v4_config(size: str, layers: int | None = None) -> dict:
    """config.json of a DeepSeek-V4 demo model of `size`, with `layers` layers (None: the size's)."""
    if size not in CONFIGS:
        raise ConfigError(f"unknown demo model size {size!r} for --arch {ARCH}; use one of {', '.join(CONFIGS)}")
    cfg = dict(CONFIGS[size])
    n = demo_layers(cfg["num_hidden_layers"], layers)
    types = cfg.pop("layer_types", None) or [HCA] * 2 + [CSA if i % 2 else HCA for i in range(max(cfg["num_hidden_layers"] - 2, 0))]
    cfg["layer_types"] = (types * -(-n // len(types)))[:n]
    n_hash = min(cfg.pop("num_hash_layers"), n)
    cfg["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    cfg["num_hidden_layers"] = n
    cfg["bos_token_id"], cfg["eos_token_id"] = 0, 2  # the demo tokenizer's <|endoftext|> and <|im_end|>
    cfg["dtype"] = "bfloat16"
    return dict(sorted(cfg.items()))


def v4_tensors(cfg: dict) -> list[DemoTensor]:
    """Every tensor of a DeepSeek-V4 demo config, in checkpoint order, under the release's names."""
    h, v, nh, d = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, e, mi, hc = cfg["q_lora_rank"], cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hc_mult"]
    g, gl, di, ih = cfg["o_groups"], cfg["o_lora_rank"], cfg["index_head_dim"], cfg["index_n_heads"]
    T = DemoTensor
    out = [T("embed.weight", (v, h))]
    for i, kind in enumerate(cfg["layer_types"]):
        p, a, f = f"layers.{i}.", f"layers.{i}.attn.", f"layers.{i}.ffn."
        out += [T(p + "attn_norm.weight", (h,), "F32", "ones"), T(p + "ffn_norm.weight", (h,), "F32", "ones")]
        for hcx in ("hc_attn", "hc_ffn"):
            out += [T(f"{p}{hcx}_fn", ((2 + hc) * hc, hc * h), "F32"), T(f"{p}{hcx}_base", ((2 + hc) * hc,), "F32",
                                                                          "zeros"), T(f"{p}{hcx}_scale", (3,), "F32", "ones")]
        out += [T(a + "wq_a.weight", (ql, h)), T(a + "q_norm.weight", (ql,), "F32", "ones"),
                T(a + "wq_b.weight", (nh * d, ql)), T(a + "wkv.weight", (d, h)), T(a + "norm.weight", (d,), "F32", "ones"),
                T(a + "wo_a.weight", (g * gl, nh * d // g)), T(a + "wo_b.weight", (h, g * gl)),
                T(a + "attn_sink", (nh,), "F32", "zeros")]
        if kind != SLIDING:
            m = cfg["compress_rates"][kind]
            width = 2 * d if kind == CSA else d
            c = a + "compressor."
            out += [T(c + "wkv.weight", (width, h)), T(c + "wgate.weight", (width, h)),
                    T(c + "ape", (m, width), "F32", "zeros"), T(c + "norm.weight", (d,), "F32", "ones")]
            if kind == CSA:
                x = a + "indexer."
                out += [T(x + "compressor.wkv.weight", (2 * di, h)), T(x + "compressor.wgate.weight", (2 * di, h)),
                        T(x + "compressor.ape", (m, 2 * di), "F32", "zeros"),
                        T(x + "compressor.norm.weight", (di,), "F32", "ones"), T(x + "wq_b.weight", (ih * di, ql)),
                        T(x + "weights_proj.weight", (ih, h))]
        out.append(T(f + "gate.weight", (e, h)))
        if cfg["mlp_layer_types"][i] == "hash_moe":
            out.append(T(f + "gate.tid2eid", (v, cfg["num_experts_per_tok"]), "I32", "tid2eid"))
        else:
            out.append(T(f + "gate.bias", (e,), "F32", "zeros"))
        out += [T(f"{f}shared_experts.w{k}.weight", s) for k, s in ((1, (mi, h)), (2, (h, mi)), (3, (mi, h)))]
        out += [T(f"{f}experts.{x}.w{k}.weight", s) for x in range(e) for k, s in ((1, (mi, h)), (2, (h, mi)), (3, (mi, h)))]
    out += [T("norm.weight", (h,), "F32", "ones"), T("hc_head_fn", (hc, hc * h), "F32"),
            T("hc_head_base", (hc,), "F32", "zeros"), T("hc_head_scale", (1,), "F32", "ones"), T("head.weight", (v, h))]
    return out


def make_v4_tensor(t: DemoTensor, index: int, seed: int, std: float, num_experts: int) -> torch.Tensor:
    """Tensor `t` (the `index`-th of the checkpoint): its own generator, seeded injectively by (seed, index)."""
    dtype = t.torch_dtype
    if t.init in ("ones", "zeros"):
        return (torch.ones if t.init == "ones" else torch.zeros)(t.shape, dtype=dtype)
    gen = torch.Generator().manual_seed((zlib.crc32(f"strata-demo-v4:{seed}".encode()) + index) & 0xFFFFFFFF)
    if t.init == "tid2eid":  # k distinct experts per token id
        return torch.rand(t.shape[0], num_experts, generator=gen).argsort(dim=-1)[:, : t.shape[1]].to(dtype)
    return torch.empty(t.shape, dtype=dtype).normal_(0.0, std, generator=gen)


def v4_demo(size: str, layers: int | None, seed: int, max_shard_bytes: int, progress: bool, workers: int | None,
            experts: str = "bf16") -> tuple[dict, Callable[[Path], None]]:
    """(the marker identifying the model, a function writing every file but the marker into a directory); `experts`
    "fp8" / "mxfp4" writes the quantized release's spelling (strata.runtime.demo.deepseek_v4_quant)."""
    cfg = v4_config(size, layers)
    marker = {"strata_demo": 1, "arch": ARCH, "size": size, "num_hidden_layers": cfg["num_hidden_layers"], "seed": seed}
    if experts != "bf16":
        from strata.runtime.demo.deepseek_v4_quant import V4_EXPERTS, v4_quantization

        if experts not in V4_EXPERTS:
            raise ConfigError(f"--experts {experts!r} is invalid; use one of {', '.join(V4_EXPERTS)}")
        cfg = dict(sorted({**cfg, **v4_quantization(experts, cfg)}.items()))
        marker["experts"] = experts

    def weights(tmp: Path) -> None:
        write_v4_weights(tmp, cfg, seed, max_shard_bytes, progress, workers, experts)

    return marker, lambda tmp: write_demo_files(tmp, size, cfg, weights)


def write_v4_weights(tmp: Path, cfg: dict, seed: int, max_shard_bytes: int, progress: bool,
                     workers: int | None, experts: str = "bf16") -> None:
    """The safetensors shard(s) of `cfg` (and model.safetensors.index.json when there are several), into `tmp`."""
    tensors = v4_tensors(cfg)
    seed_index = {t.name: i for i, t in enumerate(tensors)}  # a tensor's seed: its position in the bf16 model

    def make_source(t: DemoTensor, i: int) -> torch.Tensor:
        return make_v4_tensor(t, i, seed, cfg["initializer_range"], cfg["n_routed_experts"])

    def make(t, i: int, part: int) -> torch.Tensor:
        return make_source(t, seed_index[t.name]) if isinstance(t, DemoTensor) else t.make(make_source)

    width = lambda t: t.torch_dtype.itemsize  # noqa: E731
    if experts != "bf16":  # the quantized release's tensors (values and `.scale` of each quantized weight)
        from strata.runtime.demo.deepseek_v4_quant import bytes_per_value, v4_quantized_tensors

        tensors, width = v4_quantized_tensors(tensors, experts, cfg), bytes_per_value
    write_shards(tmp, tensors, make, max_shard_bytes, progress, workers, f"demo-{ARCH}",
                 order_in_shard=lambda t: -width(t))

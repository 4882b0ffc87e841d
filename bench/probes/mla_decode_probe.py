"""MLA decode attention at DeepSeek-V3's shapes: the latent-space path (kv_b_proj absorbed, what strata runs)
against the cache window expanded through kv_b_proj each step (transformers' order), on one layer.

Times `MLAAttention.attend_absorbed` and `attend_expanded` (bf16, one call captured in a CUDA graph as the engine's
decode runs it, replayed: best of 5 rounds of 20; eager launches reported too) for
B sequences over an S-token window, and checks they agree.

    python bench/probes/mla_decode_probe.py --out DIR [--lengths 512,4096,16384] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from strata.runtime.model.attention import MLAAttention
from strata.runtime.model.config import ModelConfig

DEEPSEEK_V3 = {  # the attention part of DeepSeek-V3's config.json
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False,
}


def time_us(fn, rounds: int = 5, calls: int = 20) -> float:
    """Best mean us a call of `fn` over `rounds` rounds of `calls` calls, launched eagerly."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def graph_us(fn, rounds: int = 5, calls: int = 20) -> float:
    """`time_us` of one call captured in a CUDA graph and replayed: the GPU's time without launch overhead, as in
    strata's decode graphs (eagerly, a few-kernel call at small sizes times the host's launches, not the GPU)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    us = time_us(graph.replay, rounds, calls)
    del graph
    return us


def probe(attn: MLAAttention, b: int, s: int) -> dict:
    """Both paths for b sequences at the end of an s-token window: agreement and us a call."""
    g = dict(device="cuda", dtype=torch.bfloat16)
    args = (torch.randn(b, attn.num_heads, attn.nope, **g), torch.randn(b, attn.num_heads, attn.rope_dim, **g),
            torch.randn(b, s, attn.kv_lora_rank, **g), torch.randn(b, s, attn.rope_dim, **g),
            torch.full((b,), s - 1, device="cuda"))
    with torch.no_grad():
        a, e = attn.attend_absorbed(*args).float(), attn.attend_expanded(*args).float()
        rec = {"batch": b, "length": s, "rel_err": round(((a - e).norm() / e.norm()).item(), 5),
               "absorbed_us": round(graph_us(lambda: attn.attend_absorbed(*args)), 1),
               "expanded_us": round(graph_us(lambda: attn.attend_expanded(*args)), 1),
               "absorbed_eager_us": round(time_us(lambda: attn.attend_absorbed(*args)), 1),
               "expanded_eager_us": round(time_us(lambda: attn.attend_expanded(*args)), 1)}
    rec["speedup"] = round(rec["expanded_us"] / rec["absorbed_us"], 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="512,4096,16384")
    ap.add_argument("--batch", default="1,8")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    torch.manual_seed(0)
    attn = MLAAttention(cfg, 0).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    results = []
    for b in (int(v) for v in args.batch.split(",")):
        for s in (int(v) for v in args.lengths.split(",")):
            results.append(probe(attn, b, s))
            print(json.dumps(results[-1]), flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "mla_decode.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

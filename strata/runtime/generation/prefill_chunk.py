"""How many prompt tokens one prefill forward pass takes (`runtime.prefill_chunk = "auto"`).

On a tiered model every cold expert of a layer crosses PCIe once per chunk, so the chunk decides how
many times a long prompt moves the experts: an 8K-token prompt at a 25% GPU budget prefilled at 4.7K tok/s
in 512-token chunks, 13.2K in 2048-token chunks and 41.0K in one chunk on the H200 box (4-layer bench
model, `bench/tools/profile_prefill.py --chunk N`, code 3e45210). What bounds the chunk is GPU memory for its
activations, which `planner.activation_reserve` keeps free: "auto" on CUDA takes the largest multiple of 512 tokens whose
activations (a generous estimate from the model's shape, plus one grouped-GEMM piece's temporaries) fill at
most three quarters of that reserve, up to 8192 and the context; on the CPU it stays at 512 (host memory, and no copies to save).
"""

from __future__ import annotations

import torch

from strata.kernels.gpu.experts.grouped_gemm import PIECE_ROWS
from strata.runtime.model.config import ModelConfig

CPU_CHUNK = 512  # and the smallest "auto" gives on CUDA
MAX_AUTO_CHUNK = 8192
STEP = 512
RESERVE_SHARE = 0.75  # of planner.activation_reserve; the rest for the allocator's slack and decode graphs


def activation_bytes_per_token(mc: ModelConfig) -> int:
    """An upper estimate of the GPU bytes one token of a prefill chunk needs while a layer runs.

    Counted in fp32 whatever the compute dtype: the residual stream, its norms and the routed sum (8 x hidden),
    attention's projections (q, k, v, output for every head), the router's scores, and the larger of the dense
    MLP (gate, up, product) and the routed pairs' output buffer (k x hidden, fp32: the grouped prefill sums each
    token's pairs once, in order) with the shared expert. The GEMMs' own temporaries are bounded by
    `PIECE_ROWS` pairs at a time (`piece_bytes`). The bench model (Qwen3-30B-A3B's shape) measured 93 KiB of
    peak GPU memory a chunk token beyond the start on the H200 box (8K prompt, one chunk,
    `bench/tools/profile_prefill.py`, code 30ffa15); this gives 177 KiB."""
    h, k = mc.hidden_size, max(mc.num_experts_per_tok, 1)
    head = max(mc.head_dim, mc.qk_nope_head_dim + mc.qk_rope_head_dim, mc.v_head_dim)
    attention = 2 * (mc.num_heads + 2 * mc.num_kv_heads) * head
    if (s := mc.qwen3_5) is not None:  # a Gated DeltaNet layer's chunked scan: fp32 q, k, v and their products per
        # value head (7 key-wide, 4 value-wide, 3 rows of the 64-token chunk), beside its projections
        hv = s.linear_num_value_heads
        delta = hv * (7 * s.linear_key_head_dim + 4 * s.linear_value_head_dim + 3 * 64) + 2 * s.conv_dim + s.value_dim
        attention = max(attention, delta)
    mlp = max(3 * mc.intermediate_size, k * h + 3 * mc.shared_expert_intermediate_size)
    return 4 * (8 * h + attention + mlp + mc.num_experts)


def piece_bytes(mc: ModelConfig) -> int:
    """GPU bytes of one grouped-GEMM piece's temporaries (`PIECE_ROWS` pairs): per pair the larger of the
    gate/up stage (its input in bf16, gate/up output, fp32 activation: 2 x hidden + 12 x moe width) and the
    down stage (output and its weighted fp32 copy: 6 x hidden + 2 x moe width)."""
    h, i = mc.hidden_size, mc.moe_intermediate_size
    return PIECE_ROWS * max(2 * h + 12 * i, 6 * h + 2 * i)


def auto_prefill_chunk(mc: ModelConfig, device: torch.device, reserve_bytes: int, max_context: int) -> int:
    """`runtime.prefill_chunk = "auto"` for a model on `device` with `reserve_bytes` of VRAM kept for activations."""
    if device.type != "cuda":
        return min(CPU_CHUNK, max_context)
    room = RESERVE_SHARE * reserve_bytes - (piece_bytes(mc) if mc.num_experts else 0)
    fits = int(max(room, 0) / activation_bytes_per_token(mc)) // STEP * STEP
    return min(max(CPU_CHUNK, fits), MAX_AUTO_CHUNK, max_context)


def resolve_prefill_chunk(setting: int | str, mc: ModelConfig, device: torch.device, reserve_bytes: int,
                          max_context: int) -> int:
    """The configured chunk, or the "auto" one."""
    return auto_prefill_chunk(mc, device, reserve_bytes, max_context) if setting == "auto" else int(setting)


def score_chunk(chunk: int, vocab_size: int, reserve_bytes: int) -> int:
    """The chunk `Engine.score` prefills with: it also keeps every position's logits ([chunk, vocab] fp32, with
    their log-softmax and a copy: 12 bytes a vocabulary entry), which for a 150K vocabulary outweigh the
    activations; at most half the reserve goes to them."""
    return max(1, min(chunk, reserve_bytes // 2 // (12 * max(vocab_size, 1))))

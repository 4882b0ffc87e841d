"""`GptOssTransformer`: gpt-oss as transformers 5.25's `GptOssForCausalLM` computes it, with `MoETransformer`'s
interface (forward over a `StepBatch` and its `KVCache`, `logits`, observers), so the engine, scheduler, planner and
tiered executor run it like the other architectures.

    x = embed(ids)                                                      [N, H]
    per layer: x = x + attention(input_layernorm(x))                    sinks; sliding window or full by layer_types
               x = x + moe(post_attention_layernorm(x))                 biased router, biased clamped SwiGLU experts
    hidden = norm(x)                                                    RMS norms with fp32 weights, rounded once

Decode steps on CUDA run as `DecodeBatch` steps (fixed shapes: attention over the step's `kv_len` bucket, with sinks,
`GptOssAttention.attend_decode_batch`) and are captured in CUDA graphs as the build's mode says: the experts run the
decode pair kernels in their clamped form with the gate_up biases, the down biases added in the combine
(strata.runtime.model.gpt_oss.moe), so a step needs the host only for cold experts (segmented graphs).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm
from strata.runtime.model.eager import EagerTransformer
from strata.runtime.model.gpt_oss.attention import GptOssAttention
from strata.runtime.model.gpt_oss.moe import GptOssMoE
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch

FP32_NORMS = ("input_layernorm.", "post_attention_layernorm.")  # and the final norm: transformers' fp32 modules
# model parameter -> checkpoint name, where they differ: the dense expert biases sit beside the experts in the file
_BIAS_NAMES = (".mlp.expert_bias.", ".mlp.experts.")


class GptOssLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer)
        self.post_attention_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch | DecodeBatch,
                cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class GptOssTransformer(EagerTransformer):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32. Decode steps
    on CUDA run as DecodeBatch steps, captured in CUDA graphs as the build says."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, nn.ModuleList(GptOssLayer(cfg, i) for i in range(cfg.num_layers)),
                         FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """Whether parameter `name` stays fp32 whatever the model's dtype (transformers' `_keep_in_fp32_modules`)."""
        return name == "norm.weight" or any(part in name for part in FP32_NORMS)

    @staticmethod
    def checkpoint_name(param: str) -> str:
        """Model parameter name -> its checkpoint name (transformers': under `model.` but lm_head; the dense expert
        biases as `mlp.experts.gate_up_proj_bias` / `down_proj_bias`)."""
        if param.startswith("lm_head."):
            return param
        return "model." + param.replace(*_BIAS_NAMES)

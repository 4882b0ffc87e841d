"""`Qwen35Transformer`: Qwen3.5 / 3.6 MoE as transformers 5.25's `Qwen3_5MoeForCausalLM` computes it (the language
model of the multimodal releases), with `MoETransformer`'s interface (forward over a `StepBatch` and its cache,
`logits`, observers), so the engine, scheduler, planner and tiered executor run it like the other architectures.

    x = embed(ids)                                                      [N, H]
    per layer: x = x + mixer(input_layernorm(x))                        Gated DeltaNet or gated full attention,
                                                                        as config.json's layer_types says
               x = x + moe(post_attention_layernorm(x))                 routed experts (strata's MoEBlock, tiered
                                                                        like qwen3_moe's) + the sigmoid-gated
                                                                        shared expert
    hidden = norm(x)                                                    zero-centred RMS norms throughout

Its layers take `DecodeBatch` decode steps (fixed shapes: each linear layer's states gathered by slot, stepped and
written back; each full-attention layer's keys written at each sequence's position and attended over the step's
`kv_len` bucket), so on CUDA its decode steps are captured in CUDA graphs as the build's mode says, like the other
architectures'. The multi-token-prediction layers (`mtp.*`) and the vision tower of a release are not built.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.runtime.model.config import ModelConfig
from strata.runtime.model.eager import EagerTransformer
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.moe import MoEBlock
from strata.runtime.model.qwen3_5.attention import GatedAttention
from strata.runtime.model.qwen3_5.cache import Qwen35Cache
from strata.runtime.model.qwen3_5.linear_attention import GatedDeltaNet
from strata.runtime.model.qwen3_5.norms import ZeroCenteredRMSNorm


class Qwen35Layer(nn.Module):
    """Pre-norm residual block: a Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`), then the MoE."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.is_linear = cfg.qwen3_5.is_linear(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = GatedAttention(cfg, layer)
        self.mlp = MoEBlock(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch | DecodeBatch,
                cache) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.linear_attn(h, batch, cache) if self.is_linear else self.self_attn(h, cos, sin, batch, cache)
        x, h = self.post_attention_layernorm.add_forward(x, mixed)
        return self.mlp(h, residual=x)


class Qwen35Transformer(EagerTransformer):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32. Decode steps
    on CUDA run as DecodeBatch steps, captured in CUDA graphs as the build says."""

    reuses_prefixes = False  # its cache holds a recurrent state, not rows per position (the scheduler's prefix cache)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, nn.ModuleList(Qwen35Layer(cfg, i) for i in range(cfg.num_layers)),
                         ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> Qwen35Cache:
        """The cache this model runs with."""
        return Qwen35Cache(self.cfg, num_slots, max_len, dtype, device)

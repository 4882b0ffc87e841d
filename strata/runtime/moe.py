"""The sparse MoE block: router, routed experts and (optionally gated) shared experts.

Parameter names mirror transformers' (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, ...), so a
checkpoint in either on-disk expert layout loads into the same stacked tensors. `Experts` is the
all-in-memory expert store; the tiered executor replaces it with one that pulls from the tier manager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.experts import moe_forward
from strata.kernels.grouped import SlotWeights, combine_pairs, pair_experts, use_pair_kernels
from strata.kernels.grouped_gemm import grouped_experts, grouped_ok, refuse
from strata.kernels.routing import sigmoid_group_topk, softmax_topk
from strata.runtime.layers import MLP
from strata.runtime.model_config import ModelConfig


class Router(nn.Module):
    """Scores experts for each token: `forward(x [N, H]) -> (weights [N, k] fp32, ids [N, k])`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if cfg.router == "sigmoid_group":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.router == "sigmoid_group":
            # DeepSeek keeps its router in fp32 whatever the model dtype
            logits = F.linear(x.float(), self.weight.float())
            return sigmoid_group_topk(
                logits, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                cfg.norm_topk_prob, cfg.routed_scaling_factor,
            )
        logits = F.linear(x, self.weight)
        return softmax_topk(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)


class Experts(nn.Module):
    """All routed experts of one layer stacked in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self._slot_of: torch.Tensor | None = None  # [E] int32 expert -> slot (the identity), made once
        self.grouped = False  # prefill-sized batches through grouped GEMMs (runtime.grouped_prefill)

    def _identity(self, device: torch.device) -> torch.Tensor:
        if self._slot_of is None or self._slot_of.device != device:
            self._slot_of = torch.arange(self.gate_up_proj.shape[0], dtype=torch.int32, device=device)
        return self._slot_of

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if use_pair_kernels(x, ids.numel()):  # decode: one launch per projection, no host sync
            y = torch.empty((ids.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
            pair_experts(x, SlotWeights(self.gate_up_proj, self.down_proj), self._identity(x.device), ids.reshape(-1), y)
            return combine_pairs(y, weights, x.dtype)
        if self.grouped and grouped_ok(x, sw := SlotWeights(self.gate_up_proj, self.down_proj)):
            try:
                return grouped_experts(x, weights, ids, sw, ids).to(x.dtype)  # slot = expert id
            except RuntimeError as e:  # operands torch's grouped GEMM does not take: the loop below
                refuse(x, sw, e)
        return moe_forward(x, self.gate_up_proj, self.down_proj, ids, weights)


class MoEBlock(nn.Module):
    """Routed experts plus shared experts: DeepSeek adds them, Qwen2-MoE gates them with a sigmoid."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_gated = cfg.shared_expert_gated
        shared = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        if cfg.shared_expert_gated:  # qwen2_moe names
            self.shared_expert = shared
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:  # deepseek_v3 names
            self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_gated:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

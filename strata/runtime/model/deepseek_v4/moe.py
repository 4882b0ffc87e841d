"""DeepSeek-V4's MoE layers (transformers' `DeepseekV4SparseMoeBlock`): a router, routed experts with a clipped
SwiGLU and one shared expert (also clipped), added.

Routers score every expert with `scoring_func` (sqrt(softplus(logit)) by default) and weight the chosen ones by
their scores renormalised to sum 1, times `routed_scaling_factor`. Which experts:

    moe       the top k of score + e_score_correction_bias (the bias only chooses)
    hash_moe  tid2eid[token id]: a fixed table of k experts per vocabulary entry (`HashRouter`; in a store the
              table is a table object, loaded checked into its tier, see strata.runtime.model.deepseek_v4.tables)

The block subclasses `MoEBlock`, so the tiered executor swaps its `Experts` for tier-served ones like any MoE
layer's, which compute the clipped form (`ExpertCompute.form`) in every kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.experts import SwiGLUForm, apply_experts, group_by_expert
from strata.kernels.gpu.deepseek_v4 import clipped_swiglu, route_weights
from strata.kernels.gpu.experts.grouped import use_pair_kernels
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.layers import linear, project
from strata.runtime.model.moe import Experts, MoEBlock


def expert_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router logits [N, E] -> scores [N, E] (`scoring_func`: sqrtsoftplus or sigmoid), in the logits' dtype."""
    return F.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else torch.sigmoid(logits)


class TopKRouter(nn.Module):
    """transformers' DeepseekV4TopKRouter: `forward(x [N, H]) -> (weights [N, k], ids [N, k], None)` (x [..., H]:
    its rows, as the prefetcher's predictions pass the hyper-connection streams [N, n, H])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.scoring, self.scaling = cfg.num_experts_per_tok, cfg.router, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, None]:
        logits = linear(x.reshape(-1, x.shape[-1]), self.weight)  # [N, E]
        fused = route_weights(logits, self.scoring, self.scaling, bias=self.e_score_correction_bias, k=self.k)
        if fused is not None:  # one launch on CUDA
            return fused[0], fused[1], None
        scores = expert_scores(logits, self.scoring)
        ids = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1, sorted=False).indices
        return _weights(scores, ids, self.scaling), ids, None

    def choose(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> the expert ids [..., k] `forward` picks (the prefetcher's prediction from a hidden state)."""
        return self(x)[1]


class HashRouter(nn.Module):
    """transformers' DeepseekV4HashRouter: the experts of token t are `tid2eid[t]`; the scores still weight them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.scoring, self.scaling = cfg.num_experts_per_tok, cfg.router, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """x [N, H], token_ids [N] -> (weights [N, k], ids [N, k], None). Without token ids (a prediction from a
        hidden state alone, the prefetcher's: x [..., H] is taken as rows), the ids are the top k by score instead."""
        logits = linear(x.reshape(-1, x.shape[-1]), self.weight)  # [N, E]
        if token_ids is None:
            scores = expert_scores(logits, self.scoring)
            ids = scores.topk(self.k, dim=-1).indices
            return _weights(scores, ids, self.scaling), ids, None
        ids = self.tid2eid[token_ids.to(self.tid2eid.device)].to(x.device).long()  # [N, k]
        fused = route_weights(logits, self.scoring, self.scaling, ids=ids)  # one launch on CUDA
        if fused is not None:
            return fused[0], ids, None
        return _weights(expert_scores(logits, self.scoring), ids, self.scaling), ids, None

    def choose(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> a prediction of the experts (top k by score: the token ids are not known yet)."""
        return self(x)[1]


def _weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    picked = scores.gather(1, ids)
    return picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * scaling


class ClippedMLP(nn.Module):
    """The shared expert: down(silu(min(gate, limit)) * clip(up, -limit, limit))."""

    def __init__(self, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        h = clipped_swiglu(gate, up, self.limit)  # one launch on CUDA
        if h is None:
            h = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        return project(self.down_proj, h)


class ClippedExperts(Experts):
    """All routed experts in memory (`Experts`' parameters), computed with the clipped SwiGLU, ascending by expert
    as transformers sums them, into fp32 and rounded once to the model's dtype; on the CPU each expert's products in
    fp32 on its weights upcast (the tiered CPU path's reference math: bf16 products of every token count would each
    keep a oneDNN primitive, hundreds of MB over a long prompt). Small batches on CUDA (decode steps) take the pair
    kernels in the clipped form: no host sync, so a decode step can be captured in a CUDA graph."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.form = SwiGLUForm(limit=cfg.deepseek_v4.swiglu_limit)  # the clipped SwiGLU

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None,
                used: torch.Tensor | None = None) -> torch.Tensor:
        if use_pair_kernels(x, ids.numel()):  # decode on CUDA: the pair kernels in the clipped form, no host sync
            return self.pair_forward(x, ids, weights, residual, form=self.form)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # sums in fp32 (the tiered path's too)
        groups = group_by_expert(ids, self.gate_up_proj.shape[0])
        gu, dn = self.gate_up_proj, self.down_proj
        if x.device.type == "cpu":  # fp32 products, as the tiered CPU path computes them (`cpu_forward`)
            apply_experts(x.float(), weights.float(), ids.shape[1], groups, lambda e: (gu[e].float(), dn[e].float()),
                          out=out, form=self.form)
        else:
            apply_experts(x, weights, ids.shape[1], groups, lambda e: (gu[e], dn[e]), out=out, form=self.form)
        out = out.to(x.dtype)
        return out if residual is None else residual + out


class DeepseekV4MoE(MoEBlock):
    """Router (top-k or hash), routed experts and the shared expert: `forward(x [N, H], token_ids [N]) -> [N, H]`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        nn.Module.__init__(self)
        s = cfg.deepseek_v4
        self.hashed = s.mlp_layer_types[layer] == "hash_moe"
        self.gate = HashRouter(cfg) if self.hashed else TopKRouter(cfg)
        self.experts = ClippedExperts(cfg)
        self.shared_gated = False
        self.shared_experts = ClippedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, s.swiglu_limit) \
            if cfg.shared_expert_intermediate_size else None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids, _ = self.gate(x, token_ids)
        out = self.experts(x, ids, weights.to(x.dtype))
        return out + self.shared_experts(x) if self.shared_experts is not None else out

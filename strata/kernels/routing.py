"""Expert routing: which experts each token uses and with what weight.

Three routers cover the supported architectures (semantics from transformers' modeling files):
- `softmax_topk` (Qwen2/3-MoE, Mixtral): softmax over all experts in fp32, top-k, optional renormalise;
- `sigmoid_group_topk` (DeepSeek-V3, GLM-4.5): sigmoid scores, a selection-only correction bias, group-limited
  top-k (best `topk_group` of `n_group` groups, each group scored by its top-2), optional renormalise,
  then `routed_scaling_factor`;
- `softmax_group_topk` (DeepSeek-V2): softmax scores, top-k within the best `topk_group` of `n_group` groups
  (each group scored by its best expert; all groups for V2's `greedy`), then `routed_scaling_factor`;
- `sigmoid_topk` (MiniMax-M2): sigmoid scores, the top k of score + a selection-only correction bias over all
  experts, renormalised.
All return (weights [N, k] fp32, expert ids [N, k] int64).
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k] fp32, ids [N, k]). One fused kernel on CUDA."""
    fused_out = fused.softmax_topk(logits, k, normalize)
    if fused_out is not None:
        return fused_out
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sigmoid_group_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing. logits [N, E] fp32, bias [E] (selection only) -> (weights [N, k], ids [N, k])."""
    n, e = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [N, groups]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def softmax_group_topk(logits: torch.Tensor, k: int, n_group: int, topk_group: int,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing. logits [N, E] fp32 -> (weights [N, k], ids [N, k]): softmax scores, experts outside the
    best `topk_group` groups (a group's score: its best expert) zeroed before the top-k, never renormalised."""
    n, e = logits.shape
    scores = logits.float().softmax(dim=-1)
    if topk_group < n_group:  # group_limited_greedy (greedy: every group is kept)
        group_scores = scores.view(n, n_group, e // n_group).max(dim=-1).values  # [N, groups]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
        scores = scores.masked_fill(~expert_mask.bool(), 0.0)
    weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    return weights * scaling, ids


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M2 routing. logits [N, E] (the model's dtype: transformers keeps no part of this router in fp32),
    bias [E] (selection only) -> (weights [N, k] fp32, ids [N, k]): sigmoid in fp32, the top k of score + bias,
    their scores renormalised to sum 1."""
    scores = logits.float().sigmoid()
    ids = torch.topk(scores + bias, k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids

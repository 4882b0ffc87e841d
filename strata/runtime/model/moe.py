"""The sparse MoE block: router, routed experts and (optionally gated) shared experts.

Parameter names mirror transformers' (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, ...), so a
checkpoint in either on-disk expert layout loads into the same stacked tensors. `Experts` is the
all-in-memory expert store; the tiered executor replaces it with one that pulls from the tier manager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm, moe_forward
from strata.kernels.gpu import decode_router
from strata.kernels.gpu.experts.grouped import SlotWeights, combine_pairs, pair_experts, use_pair_kernels
from strata.kernels.gpu.experts.grouped_gemm import grouped_experts, grouped_ok, refuse
from strata.kernels.routing import sigmoid_group_topk, sigmoid_topk, softmax_group_topk, softmax_topk
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.layers import MLP, linear


class Router(nn.Module):
    """Scores experts for each token: `forward(x [N, H]) -> (weights [N, k] fp32, ids [N, k], used)`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if cfg.router in ("sigmoid_group", "sigmoid_topk"):
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self._counts: dict[str, torch.Tensor] = {}  # device -> the one-launch decode router's counters

    def forward(self, x: torch.Tensor, slot_of: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [N, H] -> routing weights [N, k] fp32, expert ids [N, k] int64 and, given slot_of [E] int32 (a tiered
        layer's expert -> GPU slot), each pair's slot used [N * k] int32 where the one-launch decode router ran
        (strata.kernels.gpu.decode_router); else None."""
        cfg = self.cfg
        if cfg.router == "softmax" and decode_router.available(x, self.weight, cfg.num_experts_per_tok):
            counts = self._counts.get(str(x.device))
            if counts is None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                counts = self._counts[str(x.device)] = decode_router.new_counts(x.device)  # made eagerly, once
            if counts is not None:
                return decode_router.route(x, self.weight, cfg.num_experts_per_tok, cfg.norm_topk_prob, counts, slot_of)
        if cfg.router == "sigmoid_group":
            # DeepSeek keeps its router in fp32 whatever the model dtype
            logits = F.linear(x.float(), self.weight.float())
            return (*sigmoid_group_topk(
                logits, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                cfg.norm_topk_prob, cfg.routed_scaling_factor,
            ), None)
        if cfg.router == "softmax_group":  # DeepSeek-V2: its router in fp32 too
            return (*softmax_group_topk(F.linear(x.float(), self.weight.float()), cfg.num_experts_per_tok,
                                        cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor), None)
        if cfg.router == "sigmoid_topk":  # MiniMax-M2: logits in the model's dtype, as transformers computes them
            return (*sigmoid_topk(linear(x, self.weight), self.e_score_correction_bias, cfg.num_experts_per_tok), None)
        logits = linear(x, self.weight)
        return (*softmax_topk(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob), None)

    def choose(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] -> the expert ids [N, k] `forward` would pick (up to a tie), for a prediction that may run beside
        the layer's own routing on another stream: through the one-launch decode router with `counts`, a counter
        set of the caller's own (the router's belong to the layer's routing), or else the unfused ops."""
        cfg = self.cfg
        if counts is not None and cfg.router == "softmax" and decode_router.available(x, self.weight,
                                                                                        cfg.num_experts_per_tok):
            return decode_router.route(x, self.weight, cfg.num_experts_per_tok, cfg.norm_topk_prob, counts)[1]
        if cfg.router == "sigmoid_group":
            return sigmoid_group_topk(F.linear(x.float(), self.weight.float()), self.e_score_correction_bias,
                                      cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor)[1]
        if cfg.router == "softmax_group":
            return softmax_group_topk(F.linear(x.float(), self.weight.float()), cfg.num_experts_per_tok,
                                      cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)[1]
        if cfg.router == "sigmoid_topk":
            return sigmoid_topk(F.linear(x, self.weight), self.e_score_correction_bias, cfg.num_experts_per_tok)[1]
        return softmax_topk(F.linear(x, self.weight), cfg.num_experts_per_tok, cfg.norm_topk_prob)[1]


class Experts(nn.Module):
    """All routed experts of one layer stacked in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self._slot_of: torch.Tensor | None = None  # [E] int32 expert -> slot (the identity), made once
        self.grouped = False  # prefill-sized batches through grouped GEMMs ([debug] grouped_prefill)

    def _identity(self, device: torch.device) -> torch.Tensor:
        if self._slot_of is None or self._slot_of.device != device:
            self._slot_of = torch.arange(self.gate_up_proj.shape[0], dtype=torch.int32, device=device)
        return self._slot_of

    def pair_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None,
                     form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None,
                     extra: torch.Tensor | None = None) -> torch.Tensor:
        """A decode-sized batch on CUDA through the pair kernels, every expert its own slot: x [N, H], ids and
        weights [N, k] -> [N, H] in x's dtype (the pairs' fp32 outputs [N k, H] combined, plus `extra` [N, H] fp32
        and `residual`), the SwiGLU in `form` with `gate_up_bias` [E, 2I]. No host sync."""
        y = torch.empty((ids.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
        pair_experts(x, SlotWeights(self.gate_up_proj, self.down_proj), self._identity(x.device), ids.reshape(-1), y,
                     form=form, gate_up_bias=gate_up_bias)
        return combine_pairs(y, weights, x.dtype, extra=extra, residual=residual)

    def decode_slots(self, x: torch.Tensor) -> torch.Tensor | None:
        """The expert -> slot table [E] int32 the router should look each pair up in for this step (None: no
        lookup wanted; a tiered layer's one-graph decode wants one)."""
        return None

    def look_ahead(self, hidden: torch.Tensor) -> None:
        """The layer's residual stream hidden [N, H], before routing: a tiered layer may predict the next layer's
        experts from it (`strata.runtime.offload.warm_ahead`); nothing here."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None,
                used: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], ids and weights [N, k] -> the routed experts' sum [N, H], plus `residual` if given (the
        decode path adds it in its combine launch). `used`: the router's slot lookup (unused here)."""
        if use_pair_kernels(x, ids.numel()):  # decode: one launch per projection, no host sync
            return self.pair_forward(x, ids, weights, residual)
        out = None
        if self.grouped and grouped_ok(x, sw := SlotWeights(self.gate_up_proj, self.down_proj)):
            try:
                out = grouped_experts(x, weights, ids, sw, ids).to(x.dtype)  # slot = expert id
            except RuntimeError as e:  # operands torch's grouped GEMM does not take: the loop below
                refuse(x, sw, e)
        if out is None:
            out = moe_forward(x, self.gate_up_proj, self.down_proj, ids, weights)
        return out if residual is None else residual + out


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] (normed) -> the block's output [N, H], plus `residual` if given (the decoder layer's input:
        without shared experts the routed experts' combine adds it, one launch fewer a decode layer)."""
        if residual is not None:
            self.experts.look_ahead(residual)
        weights, ids, used = self.gate(x, self.experts.decode_slots(x))
        if self.shared_gated:
            out = self.experts(x, ids, weights, used=used)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = self.experts(x, ids, weights, used=used) + self.shared_experts(x)
        else:
            return self.experts(x, ids, weights, residual=residual, used=used)
        return out if residual is None else residual + out


def router_predictors(model: nn.Module, beside: bool = False) -> dict[int, Callable[[torch.Tensor], torch.Tensor]]:
    """layer -> f(hidden [N, H]) -> predicted expert ids [N, k], applying that layer's norm and router early, for
    each MoE layer of `model` (a `MoETransformer`).
    `beside`: for predictions that may run beside the layer's own routing on another stream (warm-ahead), through
    `Router.choose` with a counter set of their own for the one-launch decode router (made here, eagerly: the
    router's own belong to the layer's routing): one launch on the side stream, not four."""
    out = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            norm, router = layer.post_attention_layernorm, layer.mlp.gate
            counts = decode_router.new_counts(router.weight.device) if beside and router.weight.is_cuda else None
            if beside:
                out[i] = lambda h, norm=norm, router=router, counts=counts: router.choose(norm(h), counts)
            else:
                out[i] = lambda h, norm=norm, router=router: router(norm(h))[1]
    return out

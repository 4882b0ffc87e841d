"""gpt-oss's MoE layers (transformers' `GptOssMLP`): a router with a bias, and experts whose SwiGLU has biases and a
clamp, computed on whatever holds them (memory, or any tier).

    router   logits = x W^T + b [N, E]; the top k logits, softmax over those k (in the logits' dtype)
    expert   gu = x gate_up^T + b_gu [T, 2I]; gate, up = gu[:, 0::2], gu[:, 1::2] (interleaved rows, as released)
             gate = min(gate, limit); up = clamp(up, -limit, limit)
             y = ((up + 1) * gate * sigmoid(alpha * gate)) down^T + b_down [T, H]

Expert weights keep strata's orientation (gate_up [2I, H], down [H, I]) with gate_up's rows interleaved as the
release's `gate_up_proj_blocks` are: gate row j is row 2j, up row j is row 2j + 1. A transformers-saved bf16
checkpoint holds them transposed ([E, H, 2I], [E, I, H]) and is read into that orientation.

The biases (gate_up [E, 2I], down [E, H]) stay dense per layer (`ExpertBiases`, with the layer's other dense
weights), not in the experts' records: each expert stays one storage of gate_up and down in its format (the
release's MXFP4 blocks and scales kept as they are in every tier), and the biases, a few KB an expert, are read by
the expert's math wherever it runs. The expert kernels take this SwiGLU as a `SwiGLUForm` (`BiasedSwiGLU.form`)
with the gate_up biases; the down biases are added once per token outside them (`down_bias_term`). Decode on a GPU
runs the pair kernels (in memory or tiered: `ExpertCompute.form`, `expert_biases`); prompts and CPU steps the
reference math (`BiasedSwiGLU`, both biases inside it, in memory; the form and gate_up biases, tiered).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.experts import SwiGLUForm, apply_experts, down_bias_term, group_by_expert
from strata.kernels.gpu.experts.grouped import use_pair_kernels
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.layers import linear
from strata.runtime.model.moe import Experts, MoEBlock


class GptOssRouter(nn.Module):
    """transformers' GptOssTopKRouter: `forward(x [N, H]) -> (weights [N, k] in x's dtype, ids [N, k], None)`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor, slot_of: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, None]:
        logits = linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)  # [N, E]
        top, ids = torch.topk(logits, self.k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids, None

    def choose(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> the expert ids [N, k] `forward` picks (the prefetcher's prediction from a hidden state)."""
        return self(x)[1]


class ExpertBiases(nn.Module):
    """A layer's expert biases, dense: gate_up_proj_bias [E, 2I] (interleaved as gate_up's rows), down_proj_bias
    [E, H] (checkpoint names `mlp.experts.gate_up_proj_bias`, `mlp.experts.down_proj_bias`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))


class BiasedSwiGLU:
    """One layer's expert math (`strata.kernels.experts.ExpertMath`): `(expert, x [T, H], gate_up [2I, H],
    down [H, I]) -> [T, H]` in x's dtype, with that expert's biases from `biases` (read at each call, so the module's
    tensors may be loaded, moved or replaced after this is made; a row is converted to x's device and dtype)."""

    def __init__(self, biases: ExpertBiases, alpha: float, limit: float):
        self.biases, self.alpha, self.limit = biases, alpha, limit
        # the same SwiGLU as the expert kernels take it (strata.kernels.experts.SwiGLUForm), the biases beside it
        self.form = SwiGLUForm(limit=limit, alpha=alpha, up_offset=1.0, interleaved=True)

    def __call__(self, expert: int, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        b_gu = self.biases.gate_up_proj_bias[expert].to(x.device, x.dtype)
        b_down = self.biases.down_proj_bias[expert].to(x.device, x.dtype)
        return F.linear(self.form.apply(F.linear(x, gate_up, b_gu)), down, b_down)  # [T, 2I] -> [T, I] -> [T, H]


class GptOssExperts(Experts):
    """All routed experts in memory (`Experts`' gate_up_proj [E, 2I, H] and down_proj [E, H, I]). Decode-sized
    batches on CUDA: the pair kernels in `math`'s clamped form with the gate_up biases, the down biases added in the
    combine. Otherwise through `math`, ascending by expert as transformers sums them, into fp32 and rounded once to
    the model's dtype (the tiered path's sum); on the CPU each expert's products in fp32 on its weights upcast."""

    def __init__(self, cfg: ModelConfig, math: BiasedSwiGLU):
        super().__init__(cfg)
        self.math = math  # a plain object: its biases stay parameters of the block, not of the experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None,
                used: torch.Tensor | None = None) -> torch.Tensor:
        biases = self.math.biases
        if use_pair_kernels(x, ids.numel()):  # decode on CUDA: the pair kernels in the clamped form, no host sync
            return self.pair_forward(x, ids, weights, residual, form=self.math.form,
                                     gate_up_bias=biases.gate_up_proj_bias,
                                     extra=down_bias_term(weights, ids, biases.down_proj_bias))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        groups = group_by_expert(ids, self.gate_up_proj.shape[0])
        gu, dn = self.gate_up_proj, self.down_proj
        if x.device.type == "cpu":
            apply_experts(x.float(), weights.float(), ids.shape[1], groups, lambda e: (gu[e].float(), dn[e].float()),
                          out=out, math=self.math)
        else:
            apply_experts(x, weights, ids.shape[1], groups, lambda e: (gu[e], dn[e]), out=out, math=self.math)
        out = out.to(x.dtype)
        return out if residual is None else residual + out


class GptOssMoE(MoEBlock):
    """Router, routed experts and their dense biases: `forward(x [N, H], residual) -> [N, H]`. The tiered executor
    swaps `experts` for tier-served ones (as any `MoEBlock`'s) and computes them in `expert_math`'s form with its
    biases (`ExpertCompute.form`, `expert_biases`)."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        s = cfg.gpt_oss
        self.router = GptOssRouter(cfg)
        self.expert_bias = ExpertBiases(cfg)
        self.expert_math = BiasedSwiGLU(self.expert_bias, s.swiglu_alpha, s.swiglu_limit)
        self.experts = GptOssExperts(cfg, self.expert_math)
        self.shared_gated, self.shared_experts = False, None

    @property
    def gate(self) -> GptOssRouter:
        """The router under the name the prefetcher and routing statistics look for (`mlp.gate`)."""
        return self.router

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            self.experts.look_ahead(residual)
        weights, ids, _ = self.router(x)
        out = self.experts(x, ids, weights)
        return out if residual is None else residual + out

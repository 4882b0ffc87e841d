"""The Gated DeltaNet layer (transformers' Qwen3_5MoeGatedDeltaNet): linear attention with a fixed-size state.

    qkv = silu(conv1d(in_proj_qkv(x)))          [N, 2 key_dim + value_dim], a short causal convolution
    q, k, v split per head; beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated delta rule(q, k, v, g, beta)      [N, Hv, dv] (strata.runtime.model.qwen3_5.delta_rule)
    out = out_proj(norm(o, in_proj_z(x)))       the norm gated by silu(z), per value head

Each sequence's state lives in its cache slot (`LinearState`): the convolution's last K-1 inputs and the delta
rule's S per value head. A pass starting at position 0 starts from zeros, whatever the slot held before (slots are
reused, a cancelled sequence's state is left behind); later passes continue from what the last one left. Decode
rows (one token, position > 0) of every sequence in the step run as one batched step; prompt chunks run one
sequence at a time through the chunked scan. A `DecodeBatch` (one token a sequence, the slots a device tensor; a
one-token prompt too, at position 0) takes the batched step alone: its states gathered by slot (zeros at position
0), stepped and scattered back, shapes fixed by B (what a CUDA graph captures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.gpu import gated_delta
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import project
from strata.runtime.model.qwen3_5.delta_rule import causal_conv, chunk_gated_delta_rule, conv_step, gated_delta_step
from strata.runtime.model.qwen3_5.norms import GatedRMSNorm


@dataclass
class LinearState:
    """One linear-attention layer's per-slot state: conv [slots, conv_dim, K-1] (model dtype), recurrent
    [slots, Hv, dk, dv] (fp32, as transformers keeps it)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]


class GatedDeltaNet(nn.Module):
    """`forward(x [N, H], batch, state) -> [N, H]` for the flat tokens of a `StepBatch`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        s = cfg.qwen3_5
        self.layer = layer
        self.hk, self.hv = s.linear_num_key_heads, s.linear_num_value_heads
        self.dk, self.dv = s.linear_key_head_dim, s.linear_value_head_dim
        self.key_dim, self.value_dim = s.key_dim, s.value_dim
        k = s.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, k, groups=s.conv_dim, bias=False, padding=k - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(s.value_dim, cfg.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved qkv [N, conv_dim] -> q, k [N, Hk, dk], v [N, Hv, dv]."""
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = qkv.shape[0]
        return q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk), v.reshape(n, self.hv, self.dv)

    def _step(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor | int,
              state: LinearState, fresh: torch.Tensor | None = None) -> torch.Tensor:
        """One token each of B sequences continuing their states: qkv [B, conv_dim], g, beta [B, Hv], their slots
        ([B] device tensor, or one slot's index: its state stepped in place) -> [B, Hv, dv]; the states moved on.
        `fresh` [B] bool: the sequences at position 0, whose states start from zeros (not what the slot held)."""
        weight = self.conv1d.weight  # [C, 1, K]
        if isinstance(slots, int):
            conv, rec = state.conv[slots : slots + 1], state.recurrent[slots : slots + 1]
        else:  # gathered, then written back
            conv, rec = state.conv.index_select(0, slots), state.recurrent.index_select(0, slots)
        if fresh is not None:
            conv = conv.masked_fill(fresh[:, None, None], 0)  # [B, conv_dim, K-1]
            rec = rec.masked_fill(fresh[:, None, None, None], 0)  # [B, Hv, dk, dv]
        q, k, v = self._split(conv_step(qkv, conv, weight))
        out = gated_delta_step(q, k, v, g, beta, rec)
        if not isinstance(slots, int):
            state.conv.index_copy_(0, slots, conv)
            state.recurrent.index_copy_(0, slots, rec)
        return out

    def _fused_step(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    fresh: torch.Tensor, state: LinearState) -> torch.Tensor:
        """`_step` in two launches (strata.kernels.gpu.gated_delta): the convolution, then the gates and the delta
        rule, each reading and moving the slots' states in place -> [B, Hv, dv]."""
        conv = gated_delta.conv_step(qkv, state.conv, self.conv1d.weight, slots, fresh)
        return gated_delta.delta_step(conv, a, b, self.A_log, self.dt_bias, state.recurrent, slots, fresh, self.hk,
                                      self.dk, self.dv)

    def forward(self, x: torch.Tensor, batch: StepBatch | DecodeBatch, state: LinearState) -> torch.Tensor:
        n = x.shape[0]
        qkv = project(self.in_proj_qkv, x)  # [N, conv_dim]
        z = project(self.in_proj_z, x)  # [N, value_dim]
        b, a = project(self.in_proj_b, x), project(self.in_proj_a, x)  # [N, Hv] each
        decode = isinstance(batch, DecodeBatch)  # a one-token prompt takes this path too: its state starts from zeros
        if decode and gated_delta.decode_ok(qkv, state.conv, self.conv1d.weight, state.recurrent, self.dk, self.dv):
            out = self._fused_step(qkv, a, b, batch.slots_t, batch.pos_t == 0, state)
        else:
            beta = b.sigmoid()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [N, Hv] fp32
            if decode:
                out = self._step(qkv, g, beta, batch.slots_t, state, fresh=batch.pos_t == 0)
            else:
                out = self._prompt_and_steps(qkv, g, beta, batch, state)
        core = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(n, self.value_dim)
        return project(self.out_proj, core)

    def _prompt_and_steps(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: StepBatch,
                          state: LinearState) -> torch.Tensor:
        """A StepBatch's rows -> [N, Hv, dv]: its decode rows as one batched step, each prompt chunk scanned."""
        out = torch.empty(qkv.shape[0], self.hv, self.dv, dtype=qkv.dtype, device=qkv.device)
        steps = [(slot, off) for slot, start, off, length in batch.sequences() if length == 1 and start > 0]
        if steps:  # one token each, continuing a state: one batched step
            if len(steps) == 1:  # the slot's state itself, updated in place
                (slot, off), = steps
                rows, slots = slice(off, off + 1), slot
            else:
                slots = torch.tensor([s for s, _ in steps], device=qkv.device)
                rows = torch.tensor([o for _, o in steps], device=qkv.device)
            out[rows] = self._step(qkv[rows], g[rows], beta[rows], slots, state)
        for slot, start, off, length in batch.sequences():
            if length == 1 and start > 0:
                continue
            rows = slice(off, off + length)
            fresh = start == 0  # a sequence's first pass: zeros, not what the slot held
            conv_out, past = causal_conv(qkv[rows].T.unsqueeze(0), None if fresh else state.conv[slot : slot + 1],
                                         self.conv1d.weight)
            state.conv[slot] = past[0]
            q, k, v = self._split(conv_out[0].T)
            o, s = chunk_gated_delta_rule(q, k, v, g[rows], beta[rows], None if fresh else state.recurrent[slot])
            out[rows] = o
            state.recurrent[slot] = s
        return out

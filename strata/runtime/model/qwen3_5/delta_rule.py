"""The Gated DeltaNet's recurrence, as transformers 5.25's torch paths compute it: the causal short convolution and
the gated delta rule, chunked for prompt passes and one step at a time for decode.

Per value head the state S [dk, dv] (fp32) carries a sequence's whole past. A token with query q, key k (both
L2-normalised, q also scaled by dk^-1/2), value v, decay g <= 0 (log space) and write strength beta in (0, 1):

    S = exp(g) * S                    forget
    S = S + k (beta (v - k^T S))      delta rule: write the part of v the state does not predict yet
    o = q^T S                         read

`chunk_gated_delta_rule` runs a prompt's tokens 64 at a time (transformers' torch_chunk_gated_delta_rule: a
unit-triangular solve within each chunk, a sequential scan over chunks); `gated_delta_step` runs one token for each
of B sequences (torch_recurrent_gated_delta_rule), updating their states in place. Key heads serve
num_v_heads / num_k_heads consecutive value heads each.

`causal_conv` is the depthwise convolution over a sequence's last K inputs, continued from the K-1 inputs before
this pass (zeros at a sequence's start: transformers' left padding); `conv_step` the same for one token each of B
sequences, their inputs' windows updated in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked scan (transformers' default)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _value_heads(q: torch.Tensor, k: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, dk] -> [..., Hv, dk]: each key head repeated for its value heads."""
    if q.shape[dim] != heads:
        rep = heads // q.shape[dim]
        q, k = q.repeat_interleave(rep, dim=dim), k.repeat_interleave(rep, dim=dim)
    return q, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens: q, k [L, Hk, dk], v [L, Hv, dv], g, beta [L, Hv], the state before them [Hv, dk, dv]
    (None: zeros, a sequence's start) -> (outputs [L, Hv, dv] in q's dtype, the state after them [Hv, dk, dv] fp32)."""
    dtype, length = q.dtype, q.shape[0]
    hv, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    q, k = _value_heads(q, k, hv, 1)
    # [Hv, L, ...] in fp32
    q, k, v, beta, g = (x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q * dk**-0.5
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (length + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(hv, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))  # [Hv, n, C, d]
    cum = g.reshape(hv, n, chunk).cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [Hv, n, C, C]: i <- j
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, n, 1, 1]
    for i in range(n):  # the scan over chunks: read the state, then write the chunk into it
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(hv, -1, dv)[:, :length]
    return out.transpose(0, 1).to(dtype, memory_format=torch.contiguous_format), s


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv] and their states
    [B, Hv, dk, dv] fp32, updated in place -> outputs [B, Hv, dv] in q's dtype."""
    dtype = q.dtype
    hv, dk = v.shape[1], q.shape[-1]
    q, k = _value_heads(q, k, hv, 1)
    q, k, v, beta, g = (x.float() for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q / dk**0.5
    state.mul_(g.exp()[..., None, None])
    remembered = (k.unsqueeze(-2) @ state).squeeze(-2)  # k^T S: [B, Hv, dv]
    delta = (v - remembered) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2).to(dtype)


def causal_conv(x: torch.Tensor, past: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of B sequences' new inputs x [B, C, L] continuing from their previous K-1 inputs
    past [B, C, K-1] (None: zeros), weight [C, 1, K] -> (silu(conv) [B, C, L] in x's dtype, the last K-1 inputs
    [B, C, K-1], the next pass's `past`)."""
    keep = weight.shape[-1] - 1
    if past is None:
        past = x.new_zeros(x.shape[0], x.shape[1], keep)
    full = torch.cat([past.to(x.dtype), x], dim=-1).to(weight.dtype)  # [B, C, K-1 + L]
    out = F.conv1d(full, weight, groups=x.shape[1])  # [B, C, L]
    return F.silu(out).to(x.dtype), full[..., full.shape[-1] - keep :]


def conv_step(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One new input each of B sequences x [B, C], their previous K-1 inputs past [B, C, K-1] (moved on by one, in
    place), weight [C, 1, K] -> silu(conv) [B, C] in x's dtype. The K products summed in fp32 and rounded once, as
    the convolution kernels do (a K-tap convolution call costs more than the step's arithmetic)."""
    full = torch.cat([past, x.to(past.dtype).unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (full.float() * weight[:, 0].float()).sum(dim=-1).to(weight.dtype)
    past.copy_(full[..., 1:])
    return F.silu(out).to(x.dtype)

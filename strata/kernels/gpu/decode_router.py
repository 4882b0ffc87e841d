"""A decode step's softmax router in one kernel: the router's GEMV, softmax, top-k and (tiered layers) each
chosen expert's GPU slot.

Torch runs a decode token's routing as three dependent launches: cuBLAS's GEMV for the logits (reading only
E x H weights, 0.5 MB on the bench model, yet ~5 us on the H200), the fused softmax top-k (~3.3 us), and, in a
tiered layer, the gather of each pair's slot (~1.9 us). Inside a CUDA graph each launch also waits on the one
before it, so routing was ~10 us plus three launch gaps of every MoE layer's critical path.

Here the grid is (rows, expert blocks): each program computes EB experts' logits of one row, rounded to the
model dtype as torch's linear rounds them, into an fp32 scratch row; the last program of a row to finish
(an atomic count in device memory, acquire-release) reads the whole row back and runs the same softmax and
top-k as `fused._softmax_topk_kernel`, then looks each chosen expert's slot up. Results equal the torch chain
except where the GEMV's sum, added in another order, rounds a logit to the neighbouring bf16 value: a top-k
choice can then differ only between experts whose logits tie within one rounding step.

With `ENABLED` off (or the folds off) the three launches run: tests compare the two.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused, pdl

triton, tl = fused.triton, (fused.tl if fused.triton is not None else None)

ENABLED = True  # a module flag, not a setting: tests turn it off to compare with the three launches
MAX_ROWS = 16  # decode-sized batches (the graphs' largest); a prefill chunk's GEMM is cuBLAS's job
EXPERTS_PER_PROGRAM = 2  # EB: 64 programs a row on 128 experts, each reading 2 x H weights at once


def available(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """Whether `route` can take x [N, H] with router weight [E, H] and top-k `k`."""
    n, h = x.shape
    e = weight.shape[0]
    return (ENABLED and fused.fold_ok(x) and 0 < n <= MAX_ROWS and weight.dtype == x.dtype and weight.shape[1] == h
            and x.stride(1) == 1 and weight.is_contiguous() and e <= 4096 and k <= min(64, e)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def new_counts(device: torch.device) -> torch.Tensor:
    """A router's program counters: int32 [MAX_ROWS], zero between calls (each call's last programs reset them).
    One set per router: two calls in flight at once on one set would count each other's programs."""
    return torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)


def route(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool, counts: torch.Tensor,
          slot_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """softmax_topk(linear(x, weight)) in one launch: x [N, H], weight [E, H] (same dtype) -> weights [N, k] fp32,
    ids [N, k] int64 and, given slot_of [E] int32 (expert -> GPU slot, -1 none), used [N * k] int32: each pair's
    slot, read once by everything after it (None without slot_of). counts: this router's `new_counts`. Call only
    where `available` says so."""
    n, h = x.shape
    e = weight.shape[0]
    logits = torch.empty((n, e), dtype=torch.float32, device=x.device)  # scratch: the row's rounded logits
    top_w = torch.empty((n, k), dtype=torch.float32, device=x.device)
    top_i = torch.empty((n, k), dtype=torch.int64, device=x.device)
    used = torch.empty(n * k, dtype=torch.int32, device=x.device) if slot_of is not None else None
    eb = EXPERTS_PER_PROGRAM
    block_h = min(triton.next_power_of_2(h), 1024)
    _route_kernel[(n, triton.cdiv(e, eb))](
        x, weight, logits, counts, top_w, top_i, slot_of if slot_of is not None else top_w,
        used if used is not None else top_w, h, e, x.stride(0), K=k, KB=triton.next_power_of_2(k), EB=eb,
        BLOCK_H=block_h, BLOCK_E=triton.next_power_of_2(e), NORMALIZE=normalize, SLOTS=slot_of is not None,
        BF16=x.dtype == torch.bfloat16, num_warps=1 if e <= 256 else 4,  # the top-k's reductions: shuffles
        **pdl.launch(x))
    return top_w, top_i, used


if triton is not None:

    @triton.jit
    def _route_kernel(x_ptr, w_ptr, logit_ptr, count_ptr, tw_ptr, ti_ptr, slot_ptr, used_ptr, H, E, stride_x,
                      K: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, SLOTS: tl.constexpr, BF16: tl.constexpr,
                      PDL: tl.constexpr):
        row = tl.program_id(0)
        offs_e = tl.program_id(1) * EB + tl.arange(0, EB)
        em = offs_e < E
        # the weights' first round [EB, BLOCK_H]: no kernel writes them, so with PDL they are read while the kernel
        # before this one (the norm that produces x) finishes
        offs_h = tl.arange(0, BLOCK_H)
        hm = offs_h < H
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * H + offs_h[None, :], mask=em[:, None] & hm[None, :],
                     other=0.0).to(tl.float32)
        pdl.enter(PDL)
        xv = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs_h, mask=hm, other=0.0).to(tl.float32)
        acc = tl.sum(wv * xv[None, :], axis=1)
        for h0 in range(BLOCK_H, H, BLOCK_H):  # [EB, BLOCK_H] of the router's weights a round
            offs_h = h0 + tl.arange(0, BLOCK_H)
            hm = offs_h < H
            xv = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs_h, mask=hm, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * H + offs_h[None, :], mask=em[:, None] & hm[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], axis=1)
        logit = fused.round_to(acc, x_ptr.dtype.element_ty, BF16)  # torch's linear returns the model dtype
        tl.store(logit_ptr + row * E + offs_e, logit, mask=em)
        tl.debug_barrier()  # every thread's logits stored before the count says this program is done
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:  # the row's last program: every logit is in (acquire)
            tl.atomic_xchg(count_ptr + row, 0)  # for the next call (stream order)
            offs = tl.arange(0, BLOCK_E)
            mask = offs < E
            v = tl.load(logit_ptr + row * E + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            top_w, top_i = fused._softmax_topk_row(v, offs, mask, K, KB, BLOCK_E, NORMALIZE)
            slots = tl.arange(0, KB)
            keep = slots < K
            tl.store(tw_ptr + row * K + slots, top_w, mask=keep)
            tl.store(ti_ptr + row * K + slots, top_i, mask=keep)
            if SLOTS:
                tl.store(used_ptr + row * K + slots, tl.load(slot_ptr + top_i, mask=keep, other=-1), mask=keep)

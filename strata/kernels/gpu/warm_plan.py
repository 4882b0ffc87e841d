"""Warm-ahead's plan for one-graph split decode: which of the next MoE layer's predicted experts are cold, listed in
page-locked host memory for the CPU worker to read ahead (strata.runtime.offload.warm_ahead drives it; csrc/cpu_mailbox.cpp's
WarmCfg reads it).

One kernel (`plan_warm`), capturable and free of host syncs: from the predicted expert ids, the cold ones (no GPU
slot) in ascending expert order, at most S of them, their page-locked slots' addresses written into the plan's list,
0 after the last; then the plan's tag, the step's generation * `TAG_STRIDE` + the planned layer, stored last with
release semantics at system scope, so the worker reads only a whole plan of the step it serves. `plan_warm_torch` is
its reference (hosts without Triton, and the tests).
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused, pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

TAG_STRIDE = 65536  # a plan's tag: the step's generation * TAG_STRIDE + the planned layer (csrc/cpu_mailbox.cpp)


def plan_warm_torch(ids: torch.Tensor, slot_of: torch.Tensor, table: torch.Tensor, plan: torch.Tensor,
                    gen: torch.Tensor, layer: int) -> None:
    """The reference of `plan_warm` (same arguments, same result): ids [P] predicted experts, slot_of [E] int32 (-1:
    cold), table [E] int64 host addresses; plan [1 + S] int64 receives the addresses of the first S predicted cold
    experts in ascending order (then 0s) at [1:], and gen [1] int64 * TAG_STRIDE + layer at [0], last."""
    e, s = slot_of.numel(), plan.numel() - 1
    pred = torch.zeros(e, dtype=torch.bool, device=ids.device)
    pred[ids.reshape(-1).long()] = True
    cand = (pred & (slot_of < 0)).to(torch.int64)  # [E] predicted and cold
    rank = torch.cumsum(cand, 0) - cand  # [E] candidates before e
    sel = (cand > 0)[:, None] & (rank[:, None] == torch.arange(s, device=ids.device)[None, :])  # [E, S]
    plan[1:].copy_(torch.where(sel, table[:, None], 0).sum(0).to(plan.device))
    plan[0:1].copy_((gen * TAG_STRIDE + layer).to(plan.device))


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can run on `x`'s device: CUDA with Triton (or Triton's interpreter, for the tests)."""
    return triton is not None and (x.is_cuda or fused._INTERPRET)


# Arguments Triton must not specialize (strata.kernels.gpu.mailbox_pack.PACK_UNSPECIALIZED says why): P is batch-sized,
# TAG_ADD the layer, and the plan's tag and list sit at offsets of 8 bytes mod 16 in one layer parity's row and not in
# the other's; each would build the kernel again, for no faster code.
PLAN_UNSPECIALIZED = ("P", "TAG_ADD", "tag_ptr", "list_ptr")

if triton is not None:
    from strata.kernels.gpu.host_signal import fence_system, store_release

    # both switches: Triton versions differ in which one drops a pointer's alignment
    @triton.jit(do_not_specialize=PLAN_UNSPECIALIZED, do_not_specialize_on_alignment=PLAN_UNSPECIALIZED)
    def _plan_kernel(ids_ptr, slot_ptr, table_ptr, list_ptr, tag_ptr, gen_ptr, P, E, S, TAG_ADD,
                     BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, FENCE: tl.constexpr,
                     STRIDE: tl.constexpr):
        offs_p = tl.arange(0, BLOCK_P)
        pm = offs_p < P
        ids = tl.load(ids_ptr + offs_p, mask=pm, other=-1).to(tl.int32)  # [BLOCK_P] predicted experts
        offs_e = tl.arange(0, BLOCK_E)
        em = offs_e < E
        eq = (ids[None, :] == offs_e[:, None]) & pm[None, :]  # [BLOCK_E, BLOCK_P]
        pred = tl.max(tl.where(eq, 1, 0), axis=1)  # [BLOCK_E] 1: predicted
        slot = tl.load(slot_ptr + offs_e, mask=em, other=0)
        cand = tl.where(em & (pred > 0) & (slot < 0), 1, 0)  # [BLOCK_E] predicted and cold
        rank = tl.cumsum(cand, axis=0) - cand  # [BLOCK_E] candidates before e
        take = (cand > 0) & (rank < S)
        src = tl.load(table_ptr + offs_e, mask=em & take, other=0)  # [BLOCK_E] host addresses
        offs_s = tl.arange(0, BLOCK_S)
        sel = take[:, None] & (rank[:, None] == offs_s[None, :])  # [BLOCK_E, BLOCK_S]
        tl.store(list_ptr + offs_s, tl.sum(tl.where(sel, src[:, None], 0), axis=0), mask=offs_s < S)
        # the list is in host memory, for the mailbox worker: its tag last, after every thread's stores
        fence_system(tl.program_id(0), FENCE)
        tl.debug_barrier()
        store_release(tag_ptr, tl.load(gen_ptr) * STRIDE + TAG_ADD, FENCE)


def plan_warm(ids: torch.Tensor, slot_of: torch.Tensor, table: torch.Tensor, plan: torch.Tensor, gen: torch.Tensor,
              layer: int) -> None:
    """One launch: the addresses (`table` [E] int64) of the first S experts of `ids` [P] that are cold in `slot_of`
    [E] int32, in ascending expert order, then 0s, into plan[1:] ([1 + S] int64, page-locked host memory for the
    mailbox worker); then plan[0] = gen [1] int64 (device) * TAG_STRIDE + layer, stored last with release semantics
    at system scope."""
    if not available(ids):
        return plan_warm_torch(ids, slot_of, table, plan, gen, layer)
    p, e, s = ids.numel(), slot_of.numel(), plan.numel() - 1
    _plan_kernel[(1,)](ids.reshape(-1), slot_of, table, plan[1:], plan[0:1], gen, p, e, s, layer,
                       BLOCK_P=max(2, triton.next_power_of_2(p)), BLOCK_E=max(2, triton.next_power_of_2(e)),
                       BLOCK_S=max(2, triton.next_power_of_2(s)), FENCE=ids.is_cuda, STRIDE=TAG_STRIDE, num_warps=4,
                       **pdl.FP_FUSION)

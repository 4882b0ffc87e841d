"""A mailbox layer's device-side bookkeeping in one kernel: the cold pairs' split between the CPU worker and the
GPU's in-place read, and the worker's inbox, for one-graph split decode (strata.runtime.offload.mailbox).

In torch ops, `GpuShare.assign` and the inbox packing are ~35 tiny kernels a MoE layer. Inside the step's CUDA
graph each still costs a few microseconds of launch and dependency latency, and they run in series on the
step's critical path, before the worker may start. Here one kernel does it all: program 0 assigns and writes
the inbox's integers and weights; the others copy the activations. On the H200 box the GPU's time between two
layers' CPU shares (the worker's `gpu_gap`) fell from ~175 to ~104 us (all in VRAM a layer takes ~88 us), and
split decode ran 17% (uniform routing) to 27% (skewed) faster (docs/benchmarks.md, section "What changed the
figures most", 2dbc8c9).

The assignment is `GpuShare.assign`'s, op for op in fp32 (the torch version stays the reference, and the path
of hosts without Triton; the tests compare the two on the GPU and under Triton's interpreter): a layer's c cold
experts (ascending) are c x G granules of `GpuShare.rows` rows; the GPU takes q of them, q = floor(cG s) or one
more where that ends the layer sooner, for s the share; the CPU keeps the first cG - q granules in expert order.
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import pdl

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

if triton is not None:
    from strata.kernels.gpu.host_signal import fence_system, store_release

BLOCK_X = 1024  # activations copied per program


def available(x: torch.Tensor) -> bool:
    """Whether `pack_mailbox` can run on `x`'s device (CUDA with Triton)."""
    return triton is not None and x.is_cuda


# Arguments Triton must not specialize. It builds a kernel again for each class of a plain int's value (1, a
# multiple of 16, other) and of a pointer's alignment (16 bytes or not): N and P are batch-sized and count_ptr is
# the layer's slot of an int32 array, so the warm-up's decode graphs would build this kernel ~2-3x per batch size
# for no faster code (they bound masks, or are one word).
PACK_UNSPECIALIZED = ("N", "P", "count_ptr")

if triton is not None:

    # both switches: Triton versions differ in which one drops a pointer's alignment
    @triton.jit(do_not_specialize=PACK_UNSPECIALIZED, do_not_specialize_on_alignment=PACK_UNSPECIALIZED)
    def _pack_kernel(flat_ptr, used_ptr, x_ptr, w_ptr, share_ptr, table_ptr, box_i, box_f, addr_ptr, rows_ptr,
                     ready_ptr, gen_ptr, count_ptr, zero_ptr, N, K, P, H, INTER, G, GRAN, X_OFF4, stride_x,
                     BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr, SHARE: tl.constexpr,
                     READY: tl.constexpr, FENCE: tl.constexpr, ZERO: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        pid = tl.program_id(0)
        if pid == 0:
            offs_p = tl.arange(0, BLOCK_P)
            pm = offs_p < P
            flat = tl.load(flat_ptr + offs_p, mask=pm, other=-1).to(tl.int32)  # [BLOCK_P] expert of each pair
            used = tl.load(used_ptr + offs_p, mask=pm, other=0)  # [BLOCK_P] its GPU slot, -1 cold
            if SHARE:
                offs_e = tl.arange(0, BLOCK_E)
                eq = (flat[None, :] == offs_e[:, None]) & pm[None, :]  # [BLOCK_E, BLOCK_P] pair p routed to e
                cold_e = tl.max(tl.where(eq & (used < 0)[None, :], 1, 0), axis=1)  # [BLOCK_E] 1: cold and used
                avail = tl.zeros([BLOCK_E], dtype=tl.int32) + G  # [BLOCK_E] granules of each expert
                mine = cold_e * avail  # [BLOCK_E] the split's granules of each cold expert
                total = tl.sum(mine, axis=0).to(tl.float32)  # the layer's cold granules
                s = tl.load(share_ptr)
                low = tl.floor(total * s)  # the GPU's granules rounded down...
                q = low + ((low + 1) * (1 - s) < (total - low) * s).to(tl.float32)  # ...up where that ends sooner
                before = (tl.cumsum(mine, axis=0) - mine).to(tl.float32)  # [BLOCK_E] cold granules before e's
                cpu_e = (tl.minimum(tl.maximum(total - q - before, 0.0), avail.to(tl.float32)) * GRAN).to(tl.int32)
                end_e = avail * GRAN  # [BLOCK_E] where e's in-place rows stop
                gpu_e = tl.where((cpu_e < end_e) & (cold_e > 0), 1, 0)  # [BLOCK_E] with an in-place part
                rows = tl.sum(tl.where(eq, cpu_e[:, None], 0), axis=0)  # [BLOCK_P] the worker's rows of each pair
                take = tl.sum(tl.where(eq, gpu_e[:, None], 0), axis=0) > 0  # [BLOCK_P] with an in-place part
                addr = tl.load(table_ptr + flat, mask=pm & take, other=0)  # its page-locked slot's address
                tl.store(addr_ptr + offs_p, tl.where(take, addr, 0), mask=pm)
                slots = tl.where(take & (rows == 0), -2, used)  # -2: computed whole by the GPU
            else:
                rows = tl.zeros([BLOCK_P], dtype=tl.int32) + INTER
                slots = used
            tl.store(rows_ptr + offs_p, rows, mask=pm)
            # the inbox (csrc/cpu_mailbox.cpp): int32 N, k, P, 0, experts [P], slots [P], rows [P]; fp32 w [P]
            offs4 = tl.arange(0, 4)
            tl.store(box_i + offs4, tl.where(offs4 == 0, N, tl.where(offs4 == 1, K, tl.where(offs4 == 2, P, 0))))
            tl.store(box_i + 4 + offs_p, flat, mask=pm)
            tl.store(box_i + 4 + P + offs_p, slots, mask=pm)
            tl.store(box_i + 4 + 2 * P + offs_p, rows, mask=pm)
            w = tl.load(w_ptr + offs_p, mask=pm, other=0.0).to(tl.float32)
            tl.store(box_f + X_OFF4 + N * H + offs_p, w, mask=pm)
        else:  # fp32 activations [N * H] at X_OFF4
            offs = (pid - 1) * BLOCK_X + tl.arange(0, BLOCK_X)
            m = offs < N * H
            row, col = offs // H, offs % H
            xv = tl.load(x_ptr + row * stride_x + col, mask=m, other=0.0).to(tl.float32)
            tl.store(box_f + X_OFF4 + offs, xv, mask=m)
        if READY:  # the inbox is in host memory: the last program to finish posts `ready` = the step's generation
            fence_system(pid, FENCE)  # each thread's inbox stores, before the program counts itself done
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="sys")
            if done == tl.num_programs(0) - 1:
                tl.atomic_xchg(count_ptr, 0)  # for the next step (stream order)
                store_release(ready_ptr, tl.load(gen_ptr), FENCE)
        if ZERO:  # after the post: the pairs' outputs [P * H] fp32, k * BLOCK_X of them for each activations program
            if pid > 0:
                for j in range(K):
                    offs_z = ((pid - 1) * K + j) * BLOCK_X + tl.arange(0, BLOCK_X)
                    tl.store(zero_ptr + offs_z, tl.zeros([BLOCK_X], dtype=tl.float32), mask=offs_z < P * H)


def pack_mailbox(dst: torch.Tensor, flat: torch.Tensor, used: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                 x_off: int, inter: int, share=None, layer: int = 0,
                 rows: torch.Tensor | None = None, addr: torch.Tensor | None = None,
                 ready: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 zero: torch.Tensor | None = None) -> None:
    """One kernel: write the worker's inbox for pairs `flat` [P] (their slots `used` [P] int32, -1 cold) on x
    [N, H] with routing weights [N, k] into uint8 `dst` (device; its fp32 activations at `x_off` bytes), and,
    given a `GpuShare` `share`, the GPU's part: addr [P] int64 (0: none) and rows [P] int32 (the worker's
    leading rows of each pair; the GPU computes the rest). Without a share every cold pair is the worker's whole
    (rows = `inter`). `rows` (and `addr`, with a share) are the caller's [P] buffers, written in place.

    ready = (word, gen, count): `dst` is the mailbox's inbox itself, in page-locked host memory, and the kernel
    posts it: the last of its programs to finish stores gen [1] int64 (device) into word [1] int64 (the mailbox's
    `ready`, host) with release semantics at system scope, after every program's inbox stores; count [1] int32
    (device, zero between calls) counts the programs done. No copy node then stands between the pack and the
    worker.

    zero: fp32 [P, H] (device, contiguous), zeroed by the activations' programs once the layer is posted: the
    pairs' outputs, which the GPU's kernels after this one fill (a memset node before it would sit on the layer's
    path and break its programmatic dependent launch)."""
    if triton is None:
        raise RuntimeError("the fused mailbox pack needs Triton")
    n, k = weights.shape
    p, h = flat.numel(), x.shape[1]
    if x_off % 4 or x.stride(1) != 1:
        raise ValueError("the inbox's activations must start on a 4-byte boundary, and x's rows be contiguous")
    if zero is not None and (zero.dtype != torch.float32 or zero.numel() != p * h or not zero.is_contiguous()):
        raise ValueError(f"the buffer to zero must be contiguous fp32 [{p}, {h}], got {zero.dtype} {tuple(zero.shape)}")
    weights = weights.contiguous()
    has_share = share is not None
    table = share.table[layer] if has_share else flat  # [E] int64 (an unread pointer without a share)
    addr = addr if has_share else rows
    grid = (1 + triton.cdiv(n * h, BLOCK_X),)
    word, gen, count = ready if ready is not None else (rows, rows, rows)  # unread pointers without `ready`
    _pack_kernel[grid](
        flat, used, x, weights, share.share if has_share else weights, table, dst.view(torch.int32),
        dst.view(torch.float32), addr, rows, word, gen, count, zero if zero is not None else rows, n, k, p, h, inter,
        share.granules if has_share else 1, share.rows if has_share else inter, x_off // 4, x.stride(0),
        BLOCK_P=max(2, triton.next_power_of_2(p)),
        BLOCK_E=max(2, triton.next_power_of_2(share.num_experts if has_share else 1)),
        BLOCK_X=BLOCK_X, SHARE=has_share, READY=ready is not None, FENCE=x.is_cuda, ZERO=zero is not None,
        num_warps=4 if p <= 64 else 8, **pdl.launch(x))

"""Copy-ahead for one-graph split decode: the next MoE layer's predicted cold experts, their last intermediate rows
copied from page-locked RAM into VRAM staging slots while the GPU runs the layers' serial work (attention,
routing, the combine), when PCIe would otherwise idle (strata.runtime.copy_ahead drives it).

Two kernels, both capturable and free of host syncs:
- `plan_ahead` (one program): from the predicted expert ids, the cold ones (no GPU slot) get a staging slot each, up
  to the slots there are, and the layer's budget of granules (`GpuShare.rows` rows each) is dealt out among them;
  writes the layer's maps, ahead rows [E] int32 (each expert's staged tail rows, 0: none) and staging address
  [E] int64, and the copy list for `copy_ahead`.
- `copy_ahead` (programs per staged expert, reading over PCIe through unified addressing, in 8-byte words): copies rows
  [I - a, I) of gate, of up and of down's columns into the staging slot, at the same offsets as in the host
  slot, so `pair_experts_in_place` reads the staged tail as it reads a host slot. The copy is an SM copy, not a
  copy engine's: a graph's memcpy node has fixed addresses, and these depend on the step's routing.
The mailbox pack (`strata.kernels.mailbox_pack`) then leaves each staged tail out of the CPU's and the in-place
share's rows. Torch references of both kernels (`plan_ahead_torch`, `copy_ahead_torch`) serve hosts without Triton
and the tests.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

COPY_PROGRAMS = 32  # programs per staged expert
COPY_BLOCK = 2048  # 8-byte words a program copies per iteration of the gate/up tails (16 KB of reads in flight)
COPY_ROWS = 8  # down rows a program copies per iteration (each its tail's words, padded to a power of 2)
TAG_STRIDE = 65536  # a plan's tag: the step's generation * TAG_STRIDE + the planned layer (csrc/mailbox_ahead.h)


def plan_ahead_torch(ids: torch.Tensor, slot_of: torch.Tensor, table: torch.Tensor, budget: torch.Tensor,
                     stage_base: int, slot_bytes: int, num_slots: int, granules: int, granule_rows: int,
                     rows_map: torch.Tensor, addr_map: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor,
                     copy_rows: torch.Tensor, counts: torch.Tensor | None = None,
                     tag: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """The reference of `plan_ahead` (same arguments, same results): ids [P] predicted experts, slot_of [E] int32
    (-1 cold), table [E] int64 host addresses, budget [1] int32 granules; writes rows_map [E] int32, addr_map [E]
    int64, copy_src/copy_dst [S] int64 and copy_rows [S] int32 (or int64) in place; counts[0] += the granules
    staged; tag = (word [1] int64, gen [1] int64, layer): word = gen * TAG_STRIDE + layer, last."""
    e = slot_of.numel()
    pred = torch.zeros(e, dtype=torch.bool, device=ids.device)
    pred[ids.reshape(-1).long()] = True
    cand = (pred & (slot_of < 0)).to(torch.int64)  # [E] predicted and cold
    rank = torch.cumsum(cand, 0) - cand
    take = (cand > 0) & (rank < num_slots)
    c = take.sum().clamp(min=1)
    b = budget.to(torch.int64)[0]
    g = torch.where(take, torch.clamp(b // c + (rank < b % c).to(torch.int64), max=granules), 0)  # [E] granules
    rows = (g * granule_rows).to(torch.int32)
    dst = stage_base + rank * slot_bytes
    rows_map.copy_(rows)
    addr_map.copy_(torch.where(rows > 0, dst, 0))
    sel = take[:, None] & (rank[:, None] == torch.arange(num_slots, device=ids.device)[None, :])  # [E, S]
    copy_rows.copy_(torch.where(sel, rows[:, None], 0).sum(0).to(torch.int32))
    copy_src.copy_(torch.where(sel & (rows[:, None] > 0), table[:, None], 0).sum(0))
    copy_dst.copy_(torch.where(sel & (rows[:, None] > 0), dst[:, None], 0).sum(0))
    if counts is not None:
        counts[0] += g.sum()
    if tag is not None:
        tag[0].copy_(tag[1] * TAG_STRIDE + tag[2])


def tail_offsets(rows: int, inter: int, hidden: int, down_elem: int) -> torch.Tensor:
    """Element offsets [3 * rows * H] int64 within an expert's slot of its last `rows` intermediate rows: gate
    rows [I - a, I) of gate_up [2I, H], up rows [2I - a, 2I), then down's columns [I - a, I) of each row of
    down [H, I] at element `down_elem` (the order `copy_ahead` copies them in)."""
    a = rows
    gate = (inter - a) * hidden + torch.arange(a * hidden)
    up = (2 * inter - a) * hidden + torch.arange(a * hidden)
    t = torch.arange(hidden * a)
    down = down_elem + (t // a) * inter + (inter - a) + t % a
    return torch.cat((gate, up, down))


def copy_ahead_torch(src_slots: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor, stage: torch.Tensor,
                     inter: int, hidden: int, down_elem: int) -> None:
    """The reference of `copy_ahead` on tensors, not addresses: src_slots [E, slot elements] (2-byte elements),
    experts [S] and rows [S] (0: none) -> stage [S, slot elements], each staged expert's tail rows copied in place."""
    for s, (e, a) in enumerate(zip(experts.tolist(), rows.tolist(), strict=True)):
        if a > 0:
            off = tail_offsets(a, inter, hidden, down_elem).to(stage.device)
            stage[s, off] = src_slots[e, off]


def gated_rows(rows: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    """rows [E] int32 of the tails the mailbox worker copies, or zeros where they have not landed: gate = (flag [1]
    int64, gen [1] int64, layer), landed when flag = gen * TAG_STRIDE + layer (the pack's GATE, in torch ops)."""
    flag, gen, layer = gate
    return torch.where(flag == gen * TAG_STRIDE + layer, rows, torch.zeros_like(rows))


def available(x: torch.Tensor) -> bool:
    """Whether the kernels can run on `x`'s device (CUDA with Triton)."""
    return triton is not None and x.is_cuda


# Arguments Triton must not specialize (strata.kernels.mailbox_pack.PACK_UNSPECIALIZED says why): P is batch-sized,
# TAG_ADD the layer, and the host copy list's tag and three lists sit at offsets of 8 bytes mod 16 in one layer
# parity's row and not in the other's; each would build the plan kernel again, for no faster code.
PLAN_UNSPECIALIZED = ("P", "TAG_ADD", "tag_ptr", "src_ptr", "dst_ptr", "crows_ptr")

if triton is not None:
    from strata.kernels.host_signal import fence_system, store_release

    # both switches: Triton versions differ in which one drops a pointer's alignment
    @triton.jit(do_not_specialize=PLAN_UNSPECIALIZED, do_not_specialize_on_alignment=PLAN_UNSPECIALIZED)
    def _plan_kernel(ids_ptr, slot_ptr, table_ptr, budget_ptr, rows_map_ptr, addr_map_ptr, src_ptr, dst_ptr,
                     crows_ptr, count_ptr, tag_ptr, gen_ptr, P, E, stage_base, slot_bytes, S, G, GRAN, TAG_ADD,
                     BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, COUNT: tl.constexpr,
                     TAG: tl.constexpr, FENCE: tl.constexpr, STRIDE: tl.constexpr):
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
        c = tl.maximum(tl.sum(tl.where(take, 1, 0), axis=0), 1)
        b = tl.load(budget_ptr)
        g = tl.where(take, tl.minimum(b // c + tl.where(rank < b % c, 1, 0), G), 0)  # [BLOCK_E] granules staged
        rows = g * GRAN
        dst = stage_base + rank.to(tl.int64) * slot_bytes
        tl.store(rows_map_ptr + offs_e, rows, mask=em)
        tl.store(addr_map_ptr + offs_e, tl.where(rows > 0, dst, 0), mask=em)
        src = tl.load(table_ptr + offs_e, mask=em & take, other=0)  # [BLOCK_E] host addresses
        offs_s = tl.arange(0, BLOCK_S)
        sel = (take & (rows > 0))[:, None] & (rank[:, None] == offs_s[None, :])  # [BLOCK_E, BLOCK_S]
        sm = offs_s < S
        tl.store(crows_ptr + offs_s, tl.sum(tl.where(sel, rows[:, None], 0), axis=0), mask=sm)
        tl.store(src_ptr + offs_s, tl.sum(tl.where(sel, src[:, None], 0), axis=0), mask=sm)
        tl.store(dst_ptr + offs_s, tl.sum(tl.where(sel, dst[:, None], 0), axis=0), mask=sm)
        if COUNT:
            tl.atomic_add(count_ptr, tl.sum(g, axis=0).to(tl.int64))
        if TAG:  # the copy list is in host memory, for the mailbox worker: its tag last, after every thread's stores
            fence_system(tl.program_id(0), FENCE)
            tl.debug_barrier()
            store_release(tag_ptr, tl.load(gen_ptr) * STRIDE + TAG_ADD, FENCE)

    @triton.jit
    def _copy_kernel(src_ptr, dst_ptr, crows_ptr, H, INTER, DOWN_ELEM, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     COLS: tl.constexpr, PROGRAMS: tl.constexpr):
        # in 8-byte words (4 elements): a, INTER and DOWN_ELEM are multiples of 4, the slots 8-byte aligned. No
        # division per element: the gate and up tails are two contiguous runs, down's a [H, a] tile of rows.
        s = tl.program_id(0)
        a = tl.load(crows_ptr + s).to(tl.int64)
        if a > 0:
            src = tl.load(src_ptr + s).to(tl.pointer_type(tl.int64))  # the host slot (unified addressing)
            dst = tl.load(dst_ptr + s).to(tl.pointer_type(tl.int64))  # the staging slot
            run = a * H // 4  # words of the gate tail, and of the up tail
            per = tl.cdiv(tl.cdiv(2 * run, PROGRAMS), BLOCK) * BLOCK
            start = tl.program_id(1) * per
            stop = tl.minimum(start + per, 2 * run)
            gate0 = (INTER - a) * H // 4
            up0 = (2 * INTER - a) * H // 4
            for j0 in range(start, stop, BLOCK):
                j = j0 + tl.arange(0, BLOCK).to(tl.int64)
                m = j < stop
                off = tl.where(j < run, gate0 + j, up0 + (j - run))
                tl.store(dst + off, tl.load(src + off, mask=m), mask=m)
            aw, iw = a // 4, INTER // 4
            rows = tl.cdiv(H, PROGRAMS)
            r0 = tl.program_id(1) * rows
            r1 = tl.minimum(r0 + rows, H)
            d0 = DOWN_ELEM // 4 + iw - aw
            c = tl.arange(0, COLS)
            for h0 in range(r0, r1, ROWS):
                hh = h0 + tl.arange(0, ROWS).to(tl.int64)
                m = (hh < r1)[:, None] & (c < aw)[None, :]
                off = d0 + hh[:, None] * iw + c[None, :]
                tl.store(dst + off, tl.load(src + off, mask=m), mask=m)


def plan_ahead(ids: torch.Tensor, slot_of: torch.Tensor, table: torch.Tensor, budget: torch.Tensor,
               stage_base: int, slot_bytes: int, num_slots: int, granules: int, granule_rows: int,
               rows_map: torch.Tensor, addr_map: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor,
               copy_rows: torch.Tensor, counts: torch.Tensor | None = None,
               tag: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """One launch: which of the predicted experts `ids` [P] are cold in `slot_of` [E] int32 and how many of their
    last rows to stage (`budget` [1] int32 granules of `granule_rows` rows dealt out among at most `num_slots`
    of them, in expert order; at most `granules` each): rows_map [E] int32, addr_map [E] int64 (staging slot
    `stage_base + s * slot_bytes`), and the copy list copy_src/copy_dst [S] int64, copy_rows [S] int32 or int64
    (0: none), written in place. counts [1] int64 (device), if given: += the granules staged.
    tag = (word [1] int64, gen [1] int64 device, layer): the copy list is in page-locked host memory for the
    mailbox worker to copy (csrc/mailbox_ahead.h); word = gen * TAG_STRIDE + layer is stored last, with release
    semantics at system scope."""
    if not available(ids):
        return plan_ahead_torch(ids, slot_of, table, budget, stage_base, slot_bytes, num_slots, granules,
                                granule_rows, rows_map, addr_map, copy_src, copy_dst, copy_rows, counts, tag)
    p, e = ids.numel(), slot_of.numel()
    word, gen, layer = tag if tag is not None else (copy_src, copy_src, 0)  # unread pointers without TAG
    _plan_kernel[(1,)](ids.reshape(-1), slot_of, table, budget, rows_map, addr_map, copy_src, copy_dst, copy_rows,
                       counts if counts is not None else copy_src, word, gen, p, e, stage_base, slot_bytes, num_slots,
                       granules, granule_rows, layer, BLOCK_P=max(2, triton.next_power_of_2(p)),
                       BLOCK_E=max(2, triton.next_power_of_2(e)), BLOCK_S=max(2, triton.next_power_of_2(num_slots)),
                       COUNT=counts is not None, TAG=tag is not None, FENCE=ids.is_cuda, STRIDE=TAG_STRIDE,
                       num_warps=4)


def copy_ahead(copy_src: torch.Tensor, copy_dst: torch.Tensor, copy_rows: torch.Tensor, typed: torch.Tensor,
               inter: int, hidden: int, down_elem: int) -> None:
    """One launch: for each entry s of the copy list with copy_rows[s] = a > 0, the last a intermediate rows of
    the expert at host address copy_src[s] copied to the staging slot at copy_dst[s], at the same element
    offsets (`tail_offsets`). `typed`: a one-element tensor of the weights' 2-byte dtype. CUDA with Triton."""
    if triton is None or not copy_src.is_cuda:
        raise RuntimeError("copy-ahead needs a CUDA GPU with Triton")
    if typed.element_size() != 2:
        raise ValueError("copy-ahead copies 2-byte weights (bf16, fp16)")
    if inter % 4 or down_elem % 4:
        raise ValueError("copy-ahead copies 8-byte words: the expert's intermediate size and down's offset must be "
                         "multiples of 4 elements")
    launch_copy(copy_src, copy_dst, copy_rows, inter, hidden, down_elem)


def launch_copy(copy_src, copy_dst, copy_rows, inter: int, hidden: int, down_elem: int, programs: int = COPY_PROGRAMS,
                block: int = COPY_BLOCK, rows: int = COPY_ROWS) -> None:
    """`_copy_kernel`'s launch (tests under the interpreter pass fewer, smaller programs)."""
    cols = max(2, triton.next_power_of_2(inter // 4))
    _copy_kernel[(copy_src.numel(), programs)](copy_src, copy_dst, copy_rows, hidden, inter, down_elem, BLOCK=block,
                                               ROWS=rows, COLS=cols, PROGRAMS=programs,
                                               num_warps=4)

"""DeepSeek-V4's decode-step attention chains in single Triton launches (its hyper-connections, rotary embeddings and
norms: strata.kernels.gpu.deepseek_v4). Each one launch, for a `DecodeBatch` step (runtime/model/deepseek_v4/decode.py):

    compress_step(rings, entries, kv, gate [B, width], slots, pos [B], bias, norm weight, eps, cos, sin, m, overlap)
        a decode step's compressor (runtime/model/deepseek_v4/decode.py's compress_decode): the new sources into
        the rings, the window's softmax-pooled entry normed, rotated and written where the token completes it
    window_keys(window ring, kv [B, d], slots, pos, back, entries, span, rate, picked) -> keys [B, P, d], seen [B, P]
        a decode step's keys (runtime/model/deepseek_v4/decode.py's attend_decode): the window's last `back`
        positions from the ring, the new kv (then written into the ring), the compressed entries (HCA: the first
        `span`; CSA: the indexer's picks), and which of them each query sees
    sink_softmax(scores [B, heads, P], seen [B, P], sinks [heads] fp32, scale) -> probs [B, heads, P]
        a decode step's attention weights: the scores scaled (rounded as torch rounds them), the unseen keys at -inf,
        each head's sink logit in the softmax and dropped from its output (runtime/model/deepseek_v4/decode.py)

Each computes in fp32 with the torch chain's operations and rounds where it rounds; softmax sums may add in another
order and Triton's exp differs from torch's in the last bits (tests/kernels/test_deepseek_v4_kernels.py). Callers keep
the torch chains, the reference, where these return None or False (off CUDA).
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import fused, pdl
from strata.kernels.gpu.fused import triton

if triton is not None:
    import triton.language as tl

__all__ = ["compress_step", "window_keys", "sink_softmax"]


def sink_softmax(scores: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """softmax over [scores * scale (rounded to the scores' dtype), unseen keys -inf, the head's sink] in fp32, the
    sink's weight dropped: scores [B, heads, P] (q k, unscaled), seen [B, P] bool, sinks [heads] fp32 -> [B, heads, P]
    in the scores' dtype, one launch; None where the fused kernel does not apply."""
    if scores.dim() != 3 or not fused.fused_ok(scores) or sinks.dtype != torch.float32:
        return None
    b, heads, p = scores.shape
    if seen.shape != (b, p) or seen.dtype != torch.bool or sinks.shape != (heads,) or p > 16384:
        return None
    scores, seen = scores.contiguous(), seen.contiguous()
    probs = torch.empty_like(scores)
    if b * heads:
        block = triton.next_power_of_2(p)
        _sink_softmax_kernel[(b * heads,)](scores, seen, sinks.contiguous(), probs, heads, p, float(scale), BLOCK=block,
                                           num_warps=4 if block >= 1024 else 2, **pdl.launch(scores))
    return probs


def compress_step(src_kv: torch.Tensor, src_gate: torch.Tensor, entries: torch.Tensor, kv: torch.Tensor,
                  gate: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, rate: int,
                  overlap: bool) -> bool:
    """One DecodeBatch step of a compressor in one launch, in place: the new tokens' kv, gate [B, width] into the
    source rings [slots, R, width] at p % R; the window p // m pooled as `compress_decode` pools it (per channel, a
    softmax over its source slots of gate + bias (fp32), the weights and each product rounded to kv's dtype, summed
    in fp32 and rounded), normed with `norm_weight` (fp32), rotated by cos, sin [B, r/2] (the window start's) and
    written to entries[slot, p // m] where the token completes the window. False (nothing done) where the fused
    kernel does not apply."""
    if kv.dim() != 2 or not fused.fused_ok(kv):
        return False
    b, width = kv.shape
    d = entries.shape[-1]
    ring = src_kv.shape[1]
    if (width != (2 * d if overlap else d) or ring != (2 * rate if overlap else rate) or gate.shape != kv.shape
            or src_kv.dtype != kv.dtype or src_gate.dtype != gate.dtype or entries.dtype != kv.dtype
            or bias.dtype != torch.float32 or bias.shape != (rate, width) or norm_weight.dtype != torch.float32
            or cos.shape != (b, cos.shape[1]) or 2 * cos.shape[1] > d or d % 2 or d > 4096
            or not all(t.is_contiguous() for t in (src_kv, src_gate, entries))):
        return False
    if b:
        pairs = d // 2
        chunk = min(32, triton.next_power_of_2(pairs))  # rotary pairs a program pools: [slots, chunk] tiles
        blocks = triton.cdiv(pairs, chunk)
        slots_p2 = triton.next_power_of_2(2 * rate if overlap else rate)
        partial = torch.empty(b, blocks, dtype=torch.float32, device=kv.device)
        _compress_kernel[(b, blocks)](
            src_kv, src_gate, entries, kv.contiguous(), gate.contiguous(), slots.contiguous(), pos.contiguous(),
            bias.contiguous(), norm_weight.contiguous(), cos.contiguous(), sin.contiguous(), partial,
            _tickets(kv.device, b), eps, entries.shape[1], d, cos.shape[1], blocks, M=rate, OVERLAP=overlap,
            CHUNK=chunk, BLOCKS_P2=triton.next_power_of_2(blocks), HALF=triton.next_power_of_2(pairs),
            ROWS=min(slots_p2, max(1, 2048 // chunk)), num_warps=4, **pdl.launch(kv))
    return True


_TICKETS: dict[torch.device, list[torch.Tensor]] = {}


def _tickets(device: torch.device, rows: int) -> torch.Tensor:
    """The compressor kernel's per-sequence counters [>= rows] int32 on `device`: all 0 between launches (the last
    program of a sequence resets its own), so one buffer serves every compressor and every replay of a CUDA graph.
    Made at the first step (1,024 rows, far above a decode batch); a larger batch gets a larger buffer, and the
    smaller ones are kept, since a graph captured earlier still counts in them."""
    made = _TICKETS.setdefault(device, [])
    if not made or made[-1].numel() < rows:
        made.append(torch.zeros(max(rows, 1024), dtype=torch.int32, device=device))
    return made[-1]


def window_keys(window: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, back: int,
                entries: torch.Tensor | None, span: int, rate: int, picked: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's keys = values in one launch: window [slots, ring, d] rows of positions p - back .. p - 1 (those
    below 0 read as the ring holds them and unseen), the new kv [B, d], then entries [slots, E, d]: with `picked`
    [B, k] the picks (-1: unseen), else the first `span` (seen below (p + 1) // rate) -> (keys [B, back + 1 + k or
    span, d], seen [B, same] bool); kv then goes into the ring at p % ring (after it was read). None where the fused
    kernel does not apply."""
    if kv.dim() != 2 or not fused.fused_ok(kv) or window.dtype != kv.dtype or not window.is_contiguous():
        return None
    b, d = kv.shape
    ring = window.shape[1]
    if back > ring or d > 4096 or (entries is not None and (entries.dtype != kv.dtype or not entries.is_contiguous())):
        return None
    extra = 0 if entries is None else picked.shape[1] if picked is not None else span
    total = back + 1 + extra
    keys = torch.empty(b, total, d, dtype=kv.dtype, device=kv.device)
    seen = torch.empty(b, total, dtype=torch.bool, device=kv.device)
    if b:
        rows = 8
        ent = entries if entries is not None else window
        pick = picked.contiguous() if picked is not None else slots
        _keys_kernel[(b, triton.cdiv(total, rows))](
            window, kv.contiguous(), slots.contiguous(), pos.contiguous(), ent, pick, keys, seen, ring, back, total,
            ent.shape[1], max(1, rate), d, pick.shape[-1] if picked is not None else 0, MODE=0 if entries is None
            else 2 if picked is not None else 1, ROWS=rows, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
            **pdl.launch(kv))
    return keys, seen


if triton is not None:

    @triton.jit
    def _sink_softmax_kernel(s_ptr, seen_ptr, sink_ptr, out_ptr, heads, P, scale, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        # program r: sequence r // heads, head r % heads; the sink joins the maximum and the sum, not the output
        r = tl.program_id(0).to(tl.int64)
        b = r // heads
        k = tl.arange(0, BLOCK)
        km = k < P
        pdl.enter(PDL)
        dt = out_ptr.dtype.element_ty
        raw = tl.load(s_ptr + r * P + k, mask=km, other=0.0).to(tl.float32)
        ok = km & (tl.load(seen_ptr + b * P + k, mask=km, other=0).to(tl.int1))
        x = tl.where(ok, (raw * scale).to(dt).to(tl.float32), float("-inf"))
        sink = tl.load(sink_ptr + r % heads)
        top = tl.maximum(tl.max(x, axis=0), sink)
        e = tl.where(ok, tl.exp(x - top), 0.0)
        total = tl.sum(e, axis=0) + tl.exp(sink - top)
        tl.store(out_ptr + r * P + k, (e / total).to(dt), mask=km)

    @triton.jit
    def _compress_kernel(kv_ring, g_ring, ent_ptr, kv_ptr, g_ptr, slot_ptr, pos_ptr, bias_ptr, w_ptr, cos_ptr, sin_ptr,
                         part_ptr, ticket_ptr, eps, E, D, PAIRS, BLOCKS, M: tl.constexpr, OVERLAP: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCKS_P2: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                         PDL: tl.constexpr):
        # program (b, blk): sequence b's rotary pairs [blk CHUNK, +CHUNK) (channels 2k, 2k + 1, kept as even / odd
        # halves): its share of the new source row into the rings; where the token completes window e, that share of
        # the window's pooled entry over the window's source slots j (HCA: the ring's M rows; CSA: window e - 1's
        # first half channels in slots [0, M), window e's second half in [M, 2M)), written to the entry's row with
        # its sum of squares; the sequence's last program to finish reads them all back, norms, rotates, stores
        bq = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        W = 2 * D if OVERLAP else D  # ring width
        R = 2 * M if OVERLAP else M  # ring rows
        k = blk * CHUNK + tl.arange(0, CHUNK)
        km = k < D // 2
        pdl.enter(PDL)
        slot = tl.load(slot_ptr + bq).to(tl.int64)
        p = tl.load(pos_ptr + bq).to(tl.int64)
        e = p // M
        new_row = p % R
        dt = ent_ptr.dtype.element_ty
        for c0 in tl.static_range(0, 2 if OVERLAP else 1):  # the new sources into the rings (all W channels)
            cw = c0 * D + k * 2
            for par in tl.static_range(2):
                new_v = tl.load(kv_ptr + bq * W + cw + par, mask=km)
                tl.store(kv_ring + (slot * R + new_row) * W + cw + par, new_v, mask=km)
                new_g = tl.load(g_ptr + bq * W + cw + par, mask=km)
                tl.store(g_ring + (slot * R + new_row) * W + cw + par, new_g, mask=km)
        complete = ((p + 1) % M == 0) & (e < E)  # the same for all of the sequence's programs
        if complete:
            tl.debug_barrier()  # the new row's stores before any of this program's threads reads the ring
            SLOTS: tl.constexpr = 2 * M if OVERLAP else M
            # pass 1: each channel's maximum and sum of exp over the window's slots (online, fp32)
            mx_e = tl.full([CHUNK], float("-inf"), tl.float32)
            mx_o = tl.full([CHUNK], float("-inf"), tl.float32)
            sm_e = tl.zeros([CHUNK], tl.float32)
            sm_o = tl.zeros([CHUNK], tl.float32)
            for j0 in tl.static_range(0, SLOTS, ROWS):
                for par in tl.static_range(2):
                    _, _, g = _window_gates(g_ring, bias_ptr, slot, e, j0, k, km, par, M, D, W, R, OVERLAP, ROWS)
                    if par == 0:
                        mx_e, sm_e = _online_softmax(mx_e, sm_e, g)
                    else:
                        mx_o, sm_o = _online_softmax(mx_o, sm_o, g)
            # pass 2: the weights and products rounded to the entries' dtype, summed in fp32 (channels past D: no slot)
            mx_e, sm_e = tl.where(km, mx_e, 0.0), tl.where(km, sm_e, 1.0)
            mx_o, sm_o = tl.where(km, mx_o, 0.0), tl.where(km, sm_o, 1.0)
            acc_e = tl.zeros([CHUNK], tl.float32)
            acc_o = tl.zeros([CHUNK], tl.float32)
            for j0 in tl.static_range(0, SLOTS, ROWS):
                for par in tl.static_range(2):
                    at, m2, g = _window_gates(g_ring, bias_ptr, slot, e, j0, k, km, par, M, D, W, R, OVERLAP, ROWS)
                    v = tl.load(kv_ring + at, mask=m2, other=0.0).to(tl.float32)
                    if par == 0:
                        acc_e += _pooled(v, g, m2, mx_e, sm_e, dt)
                    else:
                        acc_o += _pooled(v, g, m2, mx_o, sm_o, dt)
            # this share of the entry, rounded, into its row, and its sum of squares
            x_e = tl.where(km, acc_e.to(dt).to(tl.float32), 0.0)
            x_o = tl.where(km, acc_o.to(dt).to(tl.float32), 0.0)
            base = ent_ptr + (slot * E + e) * D
            tl.store(base + 2 * k, x_e.to(dt), mask=km)
            tl.store(base + 2 * k + 1, x_o.to(dt), mask=km)
            tl.store(part_ptr + bq * BLOCKS + blk, tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0))
            tl.debug_barrier()  # every thread's stores before the ticket's release
            if tl.atomic_add(ticket_ptr + bq, 1, sem="acq_rel") == BLOCKS - 1:  # the last: all shares are in
                _finish_entry(base, part_ptr + bq * BLOCKS, w_ptr, cos_ptr + bq * PAIRS, sin_ptr + bq * PAIRS, eps, D,
                              PAIRS, BLOCKS, BLOCKS_P2, HALF, dt)
                tl.store(ticket_ptr + bq, 0)

    @triton.jit
    def _online_softmax(mx, sm, g):
        # one more tile of gates g [ROWS, CHUNK] into each channel's running maximum mx and sum of exp sm [CHUNK]
        new_mx = tl.maximum(mx, tl.max(g, axis=0))
        safe = tl.where(new_mx > float("-inf"), new_mx, 0.0)
        return new_mx, sm * tl.exp(mx - safe) + tl.sum(tl.exp(g - safe[None, :]), axis=0)

    @triton.jit
    def _pooled(v, g, m2, mx, sm, dt: tl.constexpr):
        # a tile's share of each channel's pooled value: the softmax weights and each product rounded to dt, summed
        # in fp32 over the tile's counted slots m2 -> [CHUNK]
        w = (tl.exp(g - mx[None, :]) / sm[None, :]).to(dt).to(tl.float32)
        return tl.sum(tl.where(m2, (v * w).to(dt).to(tl.float32), 0.0), axis=0)

    @triton.jit
    def _window_gates(g_ring, bias_ptr, slot, e, j0, k, km, par: tl.constexpr, M: tl.constexpr, D, W, R,
                      OVERLAP: tl.constexpr, ROWS: tl.constexpr):
        # the window's source slots [j0, j0 + ROWS) at channels 2k + par: their offsets in the rings, which of them
        # count, and their gates + the position bias (fp32, -inf where they do not count) [ROWS, CHUNK]
        j = j0 + tl.arange(0, ROWS)
        ring_row, coff, brow, ok = _window_slots(j, e, M, D, OVERLAP)
        m2 = ((j < (2 * M if OVERLAP else M)) & ok)[:, None] & km[None, :]
        ch = coff[:, None] + 2 * k[None, :] + par
        at = (slot * R + ring_row[:, None]) * W + ch
        g = tl.load(g_ring + at, mask=m2, other=0.0).to(tl.float32)
        g += tl.load(bias_ptr + brow[:, None] * W + ch, mask=m2, other=0.0)
        return at, m2, tl.where(m2, g, float("-inf"))

    @triton.jit
    def _finish_entry(base, part_ptr, w_ptr, cos_ptr, sin_ptr, eps, D, PAIRS, BLOCKS, BLOCKS_P2: tl.constexpr,
                      HALF: tl.constexpr, dt: tl.constexpr):
        # the entry row [D] at `base` (rounded, not normed), normed with the fp32 weight over the shares' sums of
        # squares (added in block order), rounded, its trailing 2 PAIRS channels rotated, rounded, stored back; the
        # other programs' stores are read from L2 (".cg": this SM's L1 may hold none of them, or older ones)
        b = tl.arange(0, BLOCKS_P2)
        total = tl.sum(tl.load(part_ptr + b, mask=b < BLOCKS, other=0.0, cache_modifier=".cg"), axis=0)
        k = tl.arange(0, HALF)
        km = k < D // 2
        inv = tl.rsqrt(total / D + eps)
        x_e = tl.load(base + 2 * k, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
        x_o = tl.load(base + 2 * k + 1, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
        x_e = (tl.load(w_ptr + 2 * k, mask=km, other=0.0) * (x_e * inv)).to(dt).to(tl.float32)
        x_o = (tl.load(w_ptr + 2 * k + 1, mask=km, other=0.0) * (x_o * inv)).to(dt).to(tl.float32)
        pair = k - (D // 2 - PAIRS)  # rotary pair index of channels (2k, 2k + 1); < 0: not rotated
        rot = km & (pair >= 0)
        c = tl.load(cos_ptr + pair, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + pair, mask=rot, other=0.0).to(tl.float32)
        tl.store(base + 2 * k, tl.where(rot, x_e * c - x_o * s, x_e).to(dt), mask=km)
        tl.store(base + 2 * k + 1, tl.where(rot, x_o * c + x_e * s, x_o).to(dt), mask=km)

    @triton.jit
    def _window_slots(j, e, M: tl.constexpr, D, OVERLAP: tl.constexpr):
        # source slot j of window e: its ring row, the first channel it reads, its bias row, whether it counts
        # OVERLAP: [0, M) window e - 1's rows (ring half (e + 1) % 2), channels [0, D); [M, 2M) window e's, [D, 2D)
        if OVERLAP:
            cur = j >= M
            jj = tl.where(cur, j - M, j)
            ev = tl.zeros_like(j).to(tl.int64) + e
            half = tl.where(cur, ev % 2, (ev + 1) % 2)
            return half * M + jj, tl.where(cur, D, 0), jj, cur | (ev > 0)
        else:
            return j, tl.zeros_like(j), j, j >= 0

    @triton.jit
    def _keys_kernel(win_ptr, kv_ptr, slot_ptr, pos_ptr, ent_ptr, pick_ptr, keys_ptr, seen_ptr, RING, BACK, P, E,
                     RATE, D, K, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        # program (b, blk): sequence b's keys [blk ROWS, +ROWS): i < BACK the ring's position p - BACK + i, i == BACK
        # the new kv, past it entry t = i - BACK - 1 (MODE 1: entry t, seen below (p + 1) // RATE; MODE 2: pick t)
        bq = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK_D)
        cm = c < D
        pdl.enter(PDL)
        slot = tl.load(slot_ptr + bq).to(tl.int64)
        p = tl.load(pos_ptr + bq).to(tl.int64)
        im = i < P
        kpos = p - BACK + i
        in_win = im & (i < BACK)
        row = ((kpos % RING) + RING) % RING  # (Python's modulo: a position below 0 reads the row torch's gather reads)
        old = tl.load(win_ptr + (slot * RING + row[:, None]) * D + c[None, :], mask=in_win[:, None] & cm[None, :],
                      other=0.0)
        new = tl.load(kv_ptr + bq * D + c, mask=cm, other=0.0)[None, :]
        is_new = im & (i == BACK)
        vals = tl.where(is_new[:, None], new, old)
        seen = in_win & (kpos >= 0) | is_new
        if MODE != 0:
            t = i - BACK - 1
            in_ent = im & (t >= 0)
            if MODE == 1:
                entry = t
                seen = seen | in_ent & (t < (p + 1) // RATE)
            else:
                entry = tl.load(pick_ptr + bq * K + t, mask=in_ent, other=0).to(tl.int64)
                seen = seen | in_ent & (entry >= 0)
                entry = tl.maximum(entry, 0)
            ent = tl.load(ent_ptr + (slot * E + entry[:, None]) * D + c[None, :], mask=in_ent[:, None] & cm[None, :],
                          other=0.0)
            vals = tl.where(in_ent[:, None], ent, vals)
        tl.store(keys_ptr + (bq * P + i[:, None]) * D + c[None, :], vals, mask=im[:, None] & cm[None, :])
        tl.store(seen_ptr + bq * P + i, seen, mask=im)
        if tl.program_id(1) == 0:  # the only program reading ring row p % RING (position p - RING, key 0): after it
            tl.debug_barrier()
            tl.store(win_ptr + (slot * RING + p % RING) * D + c, tl.load(kv_ptr + bq * D + c, mask=cm), mask=cm)

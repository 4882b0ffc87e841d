"""The prefill side of `TieredExperts`: tokens grouped by expert, each GPU-served expert one GEMM over its tokens.

A prompt chunk's cold experts are staged on the GPU in batches (every cold expert crosses PCIe once per
chunk), computed by grouped GEMMs over the slots (`[debug] grouped_prefill`) or a per-expert loop; the cost
model may give the CPU the cold experts with few tokens, computed from host RAM while the GPU works, with
only those tokens' rows crossing PCIe.

A chunk with pairs enough to use nearly every expert of a layer stages the next MoE layer's experts as soon as its own
routing is known (`_stage_ahead`): their copies queue behind this layer's on the copy stream, so PCIe never
waits for the host to reach the next layer's router (which kept the copy engine busy 179 ms of a 416 ms
512-token prefill at a 25% budget on an H100, 12-layer bench model).
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels.experts import apply_experts
from strata.kernels.gpu.experts.grouped_gemm import grouped_ok, refuse, slot_pairs, sum_pairs
from strata.runtime.offload.cpu_compute import CpuShare

# a chunk stages its next layer ahead from 20 token-expert pairs an expert (a 320-token prompt of an 8-of-128 model; an
# expert then goes unused with odds ~exp(-20)). Below that the cost model's split, the cold experts with few tokens
# computed from host RAM while the rest are copied, serves the layer. On the 12-layer bench model at 25% (H100,
# `bench/probes/prefill_phases.py`, `--ahead-pairs 32` or `64` against `8`, code 897b453, medians of 3) the
# split took 0.247 / 0.299 / 0.317 / 0.379 s at 192 / 256 / 384 / 512 tokens, staged ahead 0.281 / 0.331 / 0.280 /
# 0.290: past ~20 pairs an expert the split's CPU share (its layers wait on it one by one) is the long pole, while the
# staged copies keep the link busy. Staging only the copy path's part ahead, the CPU computing the rest, lost to both
# (9f8e9b4: 0.289 / 0.300 / 0.333 s at 64 / 128 / 192 tokens)
AHEAD_PAIRS_PER_EXPERT = 20
# and only where this layer used nearly every expert (skewed routing may leave many unused at these pairs): the next
# layer is taken to use as many
AHEAD_USED_SHARE = 0.9


class PrefillPath:
    """Mixin of `TieredExperts` (which provides `layer`, `num_experts`, `compute` and `_cpu_share`)."""

    def _take_ahead(self, pairs: int, used: int):
        """This layer's experts as `_stage_ahead` staged them (the layer before, or this one first in its pass), the
        next layer's staged behind them; None when neither did. Batches staged for other layers are stale (a pass
        that stopped early) and are released."""
        self._release_ahead(keep=self.layer)
        self._stage_ahead(pairs, used)
        return self.compute.prefill_ahead.pop(self.layer, None)

    def _release_ahead(self, keep: int | None = None) -> None:
        """Unpin every batch staged ahead but `keep`'s (for a pass that stopped before the layers they were for)."""
        c = self.compute
        for layer in [layer for layer in c.prefill_ahead if layer != keep]:
            c.manager.release_staged(c.prefill_ahead.pop(layer))

    def _stage_ahead(self, pairs: int, used: int) -> None:
        """Stage the next MoE layer's experts, their copies queued behind this layer's, when `pairs` (this chunk's
        token-expert pairs) number `AHEAD_PAIRS_PER_EXPERT` an expert, this layer `used` `AHEAD_USED_SHARE` of its
        experts and the GPU tier can hold two layers' experts; a layer the one before did not stage (the first of a
        pass) stages its own first. Each layer's own stage then finds its experts mapped, their copies landing or
        landed."""
        c, e = self.compute, self.num_experts
        m = c.manager
        if pairs < AHEAD_PAIRS_PER_EXPERT * e or used < AHEAD_USED_SHARE * e or c.prefill_keeps_resident \
                or c.slots is None or m.max_acquire("gpu") < 2 * e:
            return
        at = c.moe_layers.index(self.layer) if self.layer in c.moe_layers else len(c.moe_layers)
        for layer in c.moe_layers[at : at + 2]:
            if layer in c.prefill_ahead:
                continue
            ready = sorted(m.resident_experts(layer, "gpu") | m.resident_experts(layer, "pinned"))
            if ready:
                c.prefill_ahead[layer] = m.stage_gpu(layer, ready)

    def _start_cpu_share(self, x, weights, k: int, groups) -> tuple[torch.Tensor, CpuShare]:
        """Start a many-token layer's CPU share with only its tokens' rows crossing PCIe.

        An 8K-token prompt's activations are 64 MiB in fp32 each way; its CPU share is the few experts with
        a handful of tokens each (at most a few hundred rows). Shipping whole x and a whole [N, H] partial sum
        (pageable, freshly allocated) cost ~45 ms a layer on the H200 box. The kernel starts on its own launcher
        thread (`ExpertCompute.start_cpu`), as a decode layer's share does, while this thread stages the copies, so
        its start never waits for the GIL; experts not all resident in pinned RAM go through `cpu_forward` on the
        Python worker. `groups`: [(expert, its pair indices into ids.flatten(), [n_e] int64 numpy)], ascending.
        Returns (rows [R] on x's device, the share, whose `wait()` gives the partial sum [R, H] fp32 over those
        rows)."""
        c, n = self.compute, x.shape[0]
        flat = np.concatenate([s for _, s in groups])  # [P] the share's pairs, expert by expert
        tok = flat // k
        hit = np.zeros(n, dtype=bool)
        hit[tok] = True
        rows = np.flatnonzero(hit)  # [R] sorted token rows the CPU share reads (np.unique's sort cost more)
        where = np.empty(n, dtype=np.int64)
        where[rows] = np.arange(rows.size)
        # the same pairs, renumbered into the compact [R, k]: ascending order (and so the kernel's order) kept
        parts = np.split(where[tok] * k + flat % k, np.cumsum([len(s) for _, s in groups])[:-1])
        local = [(e, part) for (e, _), part in zip(groups, parts, strict=True)]
        rows_dev = torch.from_numpy(rows).to(x.device)
        x_host, w_host = x.index_select(0, rows_dev).float().cpu(), weights.index_select(0, rows_dev).cpu()
        share = c.start_cpu(self.layer, x_host, w_host, k, local) if c.use_fast_cpu else None
        if share is None:
            future = c.pool.submit(c.cpu_forward, self.layer, x_host, w_host, k, local)
            share = CpuShare(future.result, ())
        return rows_dev, share

    def _grouped_forward(self, x, weights, groups, ids, chunk: int) -> torch.Tensor:
        """`_tier_forward` through grouped GEMMs over the GPU slots ([debug] grouped_prefill): each batch of experts
        staged at once, its pairs (known per expert) written into one [N*k, H] buffer by two grouped GEMMs; the
        pairs are summed once, in the all-in-memory order, after the last batch."""
        c = self.compute
        sel_of = dict(groups)  # expert -> its pair indices [n_e] into ids.flatten(), on x's device
        pairs = torch.zeros((ids.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
        batches = self._prefill_batches(list(sel_of), chunk)
        try:
            for staged in batches:
                try:
                    staged.wait()
                    # the batch's pairs by slot, and each slot's rows: known on the host, no sort or sync
                    by_slot = sorted(zip(staged.slots, staged.experts, strict=True))
                    slot_rows = [(slot, len(sel_of[e])) for slot, e in by_slot]
                    slot_pairs(x, weights, torch.cat([sel_of[e] for _, e in by_slot]), slot_rows, c.slots, pairs)
                finally:
                    c.manager.release_staged(staged)
        finally:
            batches.close()  # releases a batch staged ahead and not yet computed
        return sum_pairs(pairs, ids).to(x.dtype)

    def _prefill_batches(self, experts: list[int], chunk: int):
        """Yield this layer's experts staged on the GPU, batch by batch (the caller releases each).

        With `runtime.prefill_keeps_resident` (off by default) the resident experts are staged as hits and the cold
        ones stream through the step-copy slots in batches of half of them, the next batch's copies issued before
        this one is yielded (they overlap its compute): each cold expert crosses once per chunk and the tier is
        left as it was. Without it, or without step-copy slots (copy-only mode), each batch goes through the GPU
        tier (`stage_gpu`): a long prompt's cold experts then evict the residents of the layers after this one,
        so a prefill at a 25% budget copies every expert of every layer (1,552 copies for 12 x 128 on the H200
        box; kept, 12 layers prefilled an 8K prompt at 22.2K tok/s against 17.9K)."""
        m = self.compute.manager
        if not (self.compute.prefill_keeps_resident and m.stream_slots):
            for i in range(0, len(experts), chunk):
                yield m.stage_gpu(self.layer, experts[i : i + chunk])
            return
        resident = m.resident_experts(self.layer, "gpu")
        hot, cold = [e for e in experts if e in resident], [e for e in experts if e not in resident]
        step = max(1, len(m.stream_slots) // 2)
        parts = [cold[i : i + step] for i in range(0, len(cold), step)]
        ahead = m.stream_gpu(self.layer, parts[0]) if parts else None  # copying while the hits compute
        try:
            for i in range(0, len(hot), chunk):
                yield m.stage_gpu(self.layer, hot[i : i + chunk])
            for j, part in enumerate(parts):
                this, ahead = ahead, None
                if this is None:  # not streamed: not all in pinned RAM (a disk tier), or stream slots still out
                    this = m.stream_gpu(self.layer, part) or m.stage_gpu(self.layer, part)
                if j + 1 < len(parts):
                    ahead = m.stream_gpu(self.layer, parts[j + 1])  # the other half of the stream slots
                yield this
        finally:
            if ahead is not None:  # the caller stopped early (an error): nothing will compute it
                m.release_staged(ahead)

    def _plan_split(self, groups):
        """Resident experts stay on the GPU; cold ones are split between CPU compute and copies."""
        resident = self.compute.manager.resident_experts(self.layer, "gpu")
        cold = {e: len(sel) for e, sel in groups if e not in resident}
        if not cold:
            return [], groups
        on_cpu, _ = self._cpu_share(cold)
        return [g for g in groups if g[0] in on_cpu], [g for g in groups if g[0] not in on_cpu]

    def _tier_forward(self, x, weights, k, groups, device_tier: str, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Experts acquired on `device_tier` and computed where x lives, in ascending order."""
        c = self.compute
        manager = c.manager
        chunk = manager.max_acquire(device_tier)  # a budget smaller than the step is served in chunks
        if device_tier == "gpu" and c.slots is not None and ids is not None and c.grouped_prefill \
                and c.plain_math and grouped_ok(x, c.slots):
            try:
                return self._grouped_forward(x, weights, groups, ids, chunk)
            except RuntimeError as e:  # operands torch's grouped GEMM does not take: the per-expert loop
                refuse(x, c.slots, e)
        # experts of another form (DeepSeek-V4's clipped SwiGLU, gpt-oss's) sum in fp32, as the CPU's products
        # accumulate (and a bf16 index_add runs ~10x slower there), returned so for the layer's down biases
        out = torch.zeros_like(x) if c.plain_math else torch.zeros_like(x, dtype=torch.float32)
        form, bias = c.form, c.gate_up_bias(self.layer)
        for i in range(0, len(groups), chunk):
            part = groups[i : i + chunk]
            if device_tier == "gpu" and c.slots is not None:
                # a prefill chunk's experts of a layer (often all of them) staged in one batch, as in decode
                staged = manager.stage_gpu(self.layer, [e for e, _ in part])
                try:
                    staged.wait()
                    slot_of = dict(zip(staged.experts, staged.slots, strict=True))
                    # (a quantized slot's expert is dequantized to x's dtype: `QuantSlotWeights.expert`)
                    apply_experts(x, weights, k, part, lambda e, slot_of=slot_of: c.slots.expert(slot_of[e], x.dtype),
                                  out=out, form=form, gate_up_bias=bias)
                finally:
                    manager.release_staged(staged)
                continue
            handles = manager.acquire([(self.layer, e) for e, _ in part], device_tier)
            try:
                by_expert = {}
                for h in handles:
                    h.wait()
                    by_expert[h.key[1]] = h.weights(x.dtype)  # FP8 / MXFP4: dequantized, one expert at a time
                apply_experts(x, weights, k, part, by_expert.__getitem__, out=out, form=form, gate_up_bias=bias)
            finally:
                manager.release(handles)
        return out.to(x.dtype) if c.plain_math else out


"""The decode side of `TieredExperts`: pair kernels over the GPU slots, the cold pairs served by the host.

Decode (a few tokens, GPU tier): the pair kernels (`strata.kernels.gpu.experts.grouped`) compute every
(token, expert) pair whose expert is resident, finding its slot through the device map, in one
launch per projection. When every expert is resident that is the whole layer: no host round trip,
so the step can be captured in a CUDA graph. Otherwise one small copy of the step's slots tells the
host which pairs are cold; the cost model splits those between
- CPU threads computing straight from pinned RAM, concurrently with the GPU (`cpu_numerics = "fork"`),
  with only the activations crossing PCIe, and
- copies into GPU slots, computed by the same pair kernels once the copy has landed.
Once every expert sits in pinned RAM for good, a decode step is one graph instead: the cold pairs go to a native CPU
worker and the GPU's in-place reads (`_mailbox_forward`, strata.runtime.offload.mailbox).
Pair outputs are combined in one fixed order, so which tier served an expert never changes the result
(except the forked CPU kernel's rounding).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from strata.kernels.gpu.experts.grouped import combine_pairs, pair_experts, pair_experts_in_place
from strata.runtime.model.capture import current_capture_mode, current_recorder
from strata.runtime.offload.cpu_compute import CpuShare
from strata.runtime.offload.step_io import pairs_by_expert, to_host, upload


class DecodePath:
    """Mixin of `TieredExperts` (which provides `layer`, `compute`, `_cpu_share`, `_down_bias_term` and
    `_plus_down_bias`)."""

    def _decode_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None,
                        used: torch.Tensor | None) -> torch.Tensor:
        c = self.compute
        flat = ids.reshape(-1)  # [P] pair p = token p // k, its (p % k)-th expert
        if c.mailbox is not None and current_capture_mode() == "mailbox":
            return self._mailbox_forward(x, flat, weights, residual, used)
        y = torch.zeros((flat.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
        form, bias = c.form, c.gate_up_bias(self.layer)
        if c.slots is not None:
            # asked before the kernel is launched: once every copy and map entry has landed (all_resident), a
            # kernel launched after that sees them all; asked after, the last ones could still be on their way
            resident = c.all_resident()
            with c.manager.unheld_slot_reads():  # (CPU-simulated tier: a promotion's eviction waits for the pass)
                # resident pairs, no host sync (pair p's gate_up bias: row flat[p], its expert)
                used = pair_experts(x, c.slots, c.slot_of[self.layer], flat, y, form=form, gate_up_bias=bias)
            if resident:
                c.count_lookups(self.layer, flat)
                return combine_pairs(y, weights, x.dtype, extra=self._down_bias_term(ids, weights, x.device),
                                     residual=residual)
        else:  # no GPU tier: every pair is computed on the CPU
            used = torch.full_like(flat, -1, dtype=torch.int32)
        both = torch.stack((flat.to(torch.int32), used))  # [2, P] expert and slot used per pair
        cpu_out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # the CPU's weighted partial sum
        late = torch.zeros_like(flat, dtype=torch.int32)  # [P] slot + 1 of pairs copied by the host step, 0 = none
        cold = lambda: self._cold_stage(x, weights, y, both, cpu_out, late)  # noqa: E731
        recorder = current_recorder()
        if recorder is None:
            cold()
        else:  # inside a segmented CUDA-graph capture: the host work runs between replays
            recorder.host_step(cold)
        if c.slots is not None:  # the pairs whose experts the host step copied in (part of the graph)
            if bias is None:
                pair_experts(x, c.slots, c.late_slot, late, y, form=form)
            else:  # pair p from slot late_slot[late[p]], its bias row p of the pairs' own rows
                pair_experts(x, c.slots, c.late_slot[late.long()], c.pair_index(flat.numel(), x.device), y,
                             form=form, gate_up_bias=bias[flat.long()])
        return combine_pairs(y, weights, x.dtype, extra=self._plus_down_bias(cpu_out, ids, weights), residual=residual)

    def _mailbox_forward(self, x, flat, weights, residual, used) -> torch.Tensor:
        """A decode layer inside a one-graph step (CUDA): the resident pairs here, the cold ones on the mailbox worker
        (strata.runtime.offload.mailbox), which the stream waits for before the combine. No host work.

        The worker is told first: the layer's slots are looked up (one gather), the mailbox posted, and only then
        the GPU's in-place share (on this stream, behind the post) and the resident pairs (on a second stream) run,
        beside the worker, so the layer waits for the longest of the three instead of their sum."""
        c = self.compute
        hot = c.slots is not None
        # [P] int32: the GPU slot each pair reads, -1 cold. Both the worker's inbox and the resident pairs' kernel
        # read this one lookup, so a map entry landing mid-layer cannot make a pair computed twice or not at all.
        if used is None:  # the router did not look them up (fused router off, or not its shapes)
            used = c.slot_of[self.layer][flat] if hot else torch.full_like(flat, -1, dtype=torch.int32)
        # y [P, H] fp32, each pair's output from the GPU: zeroed by the exchange's pack kernel where nothing writes it
        # before the post, so no memset node stands between the router and the post
        y = torch.empty((flat.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
        if self.layer == c.moe_layers[0]:
            c.mailbox.begin_step()
        share = c.gpu_share
        if c.warm_ahead is not None:
            c.warm_ahead.join(self.layer)  # the plan made for this layer (a capture must see every fork joined)

        form, bias = c.form, c.gate_up_bias(self.layer)
        # [P, 2I]: pair p's row p, for the resident pairs' kernel (it runs pairs by index; the in-place one reads bias
        # by expert id)
        pair_bias = None if bias is None or not hot else bias[flat.long()]

        def gpu_work(addr, rows) -> None:  # enqueued once the worker has been posted the layer
            main = torch.cuda.current_stream(x.device)
            if addr is None:  # no in-place share: the resident pairs alone, on this stream
                if hot:
                    pair_experts(x, c.slots, used, c.pair_index(flat.numel(), x.device), y, form=form,
                                 gate_up_bias=pair_bias)
                return
            # The in-place share, where a layer gives the GPU rows, is its long pole beside the worker (PCIe while
            # the worker reads RAM), so it runs on this stream right behind the pack (its launch overlapped with it)
            # and the resident pairs on the second. Their rows of y are disjoint.
            side = c.side_stream(x.device)
            side.wait_stream(main)
            if hot:
                with torch.cuda.stream(side):
                    pair_experts(x, c.slots, used, c.pair_index(flat.numel(), x.device), y, form=form,
                                 gate_up_bias=pair_bias)
            pair_experts_in_place(x, share.experts, addr, y, first_row=rows, form=form, gate_up_bias=bias,
                                  expert_ids=None if bias is None else flat)
            main.wait_stream(side)

        cpu_out = c.mailbox.exchange(self.layer, flat, used, x, weights, gpu_work, share=share, zero=y)  # [N, H]
        return combine_pairs(y, weights, x.dtype, extra=self._plus_down_bias(cpu_out, flat.view(weights.shape), weights),
                             residual=residual)

    def _cold_stage(self, x, weights, y, both, cpu_out, late) -> None:
        """Host work of a decode layer: learn which pairs were cold, serve them, count the lookups."""
        c, clock = self.compute, time.perf_counter
        c.release_staged()  # the kernels reading the previous layer's copies are enqueued by now
        t0 = clock()
        # one synchronisation: the GPU has reached this layer (slots used, activations, routing weights)
        both_host, x_host, w_host = to_host(both, x.float(), weights)
        experts, slots = both_host.numpy()
        t1 = clock()
        if c.slots is not None:
            c.manager.note_hits(self.layer, np.unique(experts[slots >= 0]))  # before evictions: recency counts
        t_hits = clock()
        cold = pairs_by_expert(experts, np.flatnonzero(slots < 0))
        cpu_part = None
        t_plan = clock()
        if cold:
            cpu_part = self._cold_decode(x, x_host, w_host, y, late, cold)
        if cpu_part is not None:
            cpu_part.copy_to(cpu_out)  # pinned: no wait for the GPU queue
        t_poll = clock()
        if c.prefetcher is not None:
            c.prefetcher.poll()  # after the layer's own misses, so they go first
        c.host_seconds["wait_gpu"] += t1 - t0
        c.host_seconds["hits"] += t_hits - t1
        c.host_seconds["group"] += t_plan - t_hits
        c.host_seconds["poll"] += clock() - t_poll

    def _cold_decode(self, x, x_host, w_host, y, late, cold: dict[int, np.ndarray]) -> CpuShare | None:
        """Cold pairs: the copied ones are staged for the pass over `late` that follows this host step, then
        the CPU's share is computed here; returns it, done: its partial sum [N, H] fp32 (None: no CPU share)."""
        c, k = self.compute, w_host.shape[1]
        t_split = time.perf_counter()
        on_cpu: set[int] = set(cold) if c.slots is None else set()
        run_async = bool(c.cpu_async)
        if c.use_split and c.slots is not None:
            on_cpu, run_async = self._cpu_share({e: len(p) for e, p in cold.items()}, c.cpu_async)
            c.manager.note_gpu_misses(self.layer, on_cpu)  # the GPU tier's frequency history sees them too
            # the GPU tier's only way in for the experts no copy brings (the CPU's share): a background copy of the
            # most used one, if worth a slot
            if c.promote and on_cpu:
                c.promote_one(self.layer, on_cpu)
        groups = [(e, torch.from_numpy(cold[e])) for e in sorted(on_cpu)]  # the CPU share: (expert, its pairs)
        share = None
        if groups and run_async:  # the CPU share starts first, on the kernel's own thread
            share = c.start_cpu(self.layer, x_host, w_host, k, groups)
        to_copy = [e for e in cold if e not in on_cpu]
        t0 = time.perf_counter()
        c.host_seconds["split"] += t0 - t_split
        try:
            self._stage_copies(x, y, late, to_copy, cold)
        except BaseException:
            if share is not None:
                share.wait()  # its slots are held until it is joined
            raise
        t1 = time.perf_counter()
        c.host_seconds["stage"] += t1 - t0
        c.rates.observe_stage(len(to_copy), t1 - t0)
        if share is not None:
            share.wait()
            c.host_seconds["wait_cpu"] += time.perf_counter() - t1
            return share
        if not groups:
            return None
        # the CPU part runs here, after the copies were issued: this thread joins the kernel's thread
        # pool (the GIL is released inside) while the copy engine moves the other experts. (A Python
        # worker thread was slower: it waits for the GIL this thread holds while it issues the copies.
        # Starting it first on the kernel's launcher thread is `run_async` above.)
        out = c.cpu_forward(self.layer, x_host, w_host, k, groups)
        c.host_seconds["cpu"] += time.perf_counter() - t1
        return CpuShare.done(out)

    def _stage_copies(self, x, y, late, to_copy: list[int], cold: dict[int, np.ndarray]) -> None:
        """Issue the copies of `to_copy` and point `late` (the pass after this host step) at their slots."""
        c, m = self.compute, self.compute.manager
        if not to_copy:
            return
        batches = []
        if c.use_split:
            # the copies the GPU tier should keep (used over twice as often as its victim) are staged through it,
            # so it adapts to the traffic; the others land in the stream slots, for this step only
            keep = m.worth_caching(self.layer, to_copy)
            once = [e for e in to_copy if e not in keep]
            if once and (streamed := m.stream_gpu(self.layer, once)) is not None:
                batches.append(streamed)
                to_copy = keep
        if len(to_copy) > m.max_acquire("gpu"):  # a budget smaller than the step: in chunks, now
            self._copy_in_chunks(x, y, to_copy, cold)
        elif to_copy:
            batches.append(m.stage_gpu(self.layer, to_copy))  # one batch of copies, one event
        if not batches:
            return
        slot_plus_one = np.zeros(late.numel(), dtype=np.int32)
        for batch in batches:
            batch.wait()  # the compute stream waits for the copies; the host does not
            c.staged.append(batch)  # released once the late pass is enqueued (the next host step or layer)
            for e, slot in zip(batch.experts, batch.slots, strict=True):
                slot_plus_one[cold[e]] = slot + 1
        upload(slot_plus_one, late)

    def _copy_in_chunks(self, x, y, to_copy: list[int], cold: dict[int, np.ndarray]) -> None:
        """Copied pairs computed here, chunk by chunk, each chunk's slots released before the next is staged."""
        c = self.compute
        chunk = c.manager.max_acquire("gpu")
        for i in range(0, len(to_copy), chunk):
            staged = c.manager.stage_gpu(self.layer, to_copy[i : i + chunk])
            try:
                staged.wait()
                slot_of = dict(zip(staged.experts, staged.slots, strict=True))
                pairs = np.concatenate([np.stack((cold[e], np.full(len(cold[e]), slot_of[e])))
                                        for e in staged.experts], axis=1).astype(np.int32)  # [2, P'] rows, slots
                pairs_t = torch.empty(pairs.shape, dtype=torch.int32, device=x.device)
                upload(pairs, pairs_t)
                if (bias := c.gate_up_bias(self.layer)) is None:
                    pair_experts(x, c.slots, c.identity, pairs_t[1], y, rows=pairs_t[0], form=c.form)
                else:  # pair p from slot pairs_t[1, p], its bias row p of the pairs' own rows
                    experts = torch.from_numpy(np.concatenate([np.full(len(cold[e]), e) for e in staged.experts]))
                    pair_experts(x, c.slots, pairs_t[1], c.pair_index(pairs.shape[1], x.device), y, rows=pairs_t[0],
                                 form=c.form, gate_up_bias=bias[experts.to(bias.device)])
            finally:
                c.manager.release_staged(staged)  # later copies into these slots wait for the kernels above

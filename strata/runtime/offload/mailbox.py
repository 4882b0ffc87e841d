"""Split decode in one CUDA graph: each MoE layer's cold experts computed by a native worker that the graph
talks to through page-locked mailboxes, with no Python on the step's path.

The host-step path (`TieredExperts._cold_stage`) ends the step's graph at every MoE layer and runs Python
there: on the H200 box that host work (CUDA calls at 10-15 us each, ~0.5 ms of Python a layer) cost more
than the CPU kernel it drives. When every expert sits in page-locked RAM for good (`all_pinned`), the
worker of `csrc/cpu_mailbox.cpp` serves a layer from its mailbox instead: one kernel of the graph
(`strata.kernels.gpu.mailbox_pack`) writes the layer's pairs (expert, GPU slot or -1), activations and routing
weights there and posts the layer's `ready` word with the step's generation; the worker computes the pairs
whose expert was not resident, with the same kernel in the same order as the host path (so the same sums),
writes the partial sum and `done`; a kernel (`strata.kernels.gpu.host_signal.wait_and_fetch`) holds the stream
until `done` arrives and brings the sum into the layer's combine. (Where those kernels cannot be built, the inbox,
`ready` and the sum travel by copy nodes instead, packed by torch ops where the fused pack cannot be built either.) No
cold expert is copied, so nothing is staged: each is computed by the worker, by the GPU reading it in place over PCIe
(`GpuShare`), or split by rows between the two.

The tier policy's history and promotions (which the host step fed per layer) are fed from the worker's
log by `drain`, after the step, off its path (`strata.runtime.offload.mailbox_books`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from strata.kernels.cpu.expert_args import mailbox_forms
from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.gpu import mailbox_pack
from strata.runtime.offload.mailbox_clock import WorkerClock
from strata.tiers.storage.pinned import PinnedPool

if TYPE_CHECKING:
    from strata.kernels.quant import ExpertLayout
    from strata.runtime.offload.gpu_share import GpuShare

log = logging.getLogger(__name__)

HEADER = 64  # bytes: int64 ready, done, status, timeout, the GPU's spins waiting for done, then padding
LOG_CODES, LOG_ENTRY = 256, 16 + 4 * 256  # csrc/cpu_mailbox.cpp's log layout
SPIN_NS = 2_000_000  # the worker polls without sleeping this long after the last layer it served


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def inbox_layout(n: int, k: int, hidden: int) -> tuple[int, int]:
    """(x_off, nbytes) of an inbox for n tokens of top-k (csrc/cpu_mailbox.cpp's layout): int32 N, k, P, 0, then
    experts, slots and rows [P], padded to 64 bytes; fp32 activations [n, hidden] at x_off, then fp32 weights [P]."""
    p = n * k
    x_off = _up(16 + 12 * p, 64)
    return x_off, x_off + 4 * n * hidden + 4 * p


class CpuMailbox(WorkerClock):
    """Mailboxes of `layers` (MoE layers of the model) and the native worker serving them.

    addresses [num_layers, E] int64: each expert's gate_up block in page-locked RAM (down follows at
    `gu_bytes`); the worker reads experts through it, so it must stay valid (`all_pinned`) while open.
    `cpu_kernel`: the CPU kernel's instruction set ("auto", or one of `cpu_experts.BACKENDS` but "torch").
    `layout`: the experts' blob layout (the store's), for FP8, MXFP4 and GGUF experts, which the worker reads as
    stored: their values, scales (GGUF: type ids) and bytes come from it (gu_bytes and payload are then its own);
    None: bf16 blobs.
    `form`: the experts' SwiGLU form (strata.kernels.experts.SwiGLUForm), one for every layer or one per layer (a
    mapping of every served layer); `gate_up_bias`: each layer's gate_up bias table [E, 2I] (a mapping; layers not in
    it have none), converted once here to fp32 host memory where it is not so already, which the worker reads
    (csrc/cpu_mailbox.cpp). The worker computes its rows of each cold pair with them; the GPU's part of a split expert
    (`GpuShare`) is its own kernels'."""

    def __init__(self, layers: list[int], addresses: np.ndarray, *, hidden: int, inter: int, gu_bytes: int,
                 payload: int, top_k: int, max_tokens: int, threads: int, device: torch.device,
                 log_entries: int = 4096, cpu_kernel: str = "auto", layout: ExpertLayout | None = None,
                 form: SwiGLUForm | Mapping[int, SwiGLUForm] = PLAIN_SWIGLU,
                 gate_up_bias: Mapping[int, torch.Tensor] | None = None):
        from strata.kernels.cpu import experts as ce
        from strata.kernels.cpu.expert_args import format_args, layout_up_offset

        self.layers, self.hidden, self.inter, self.top_k, self.max_tokens = list(layers), hidden, inter, top_k, max_tokens
        self.threads = threads  # the worker's kernel threads
        self.max_pairs = max_tokens * top_k
        self.device = device
        # (checked before allocating)
        acts, biases, tables = mailbox_forms(self.layers, form, gate_up_bias, inter, addresses.shape[1])
        self.out_off = _up(HEADER + inbox_layout(max_tokens, top_k, hidden)[1], 64)
        box_bytes = _up(self.out_off + 4 * max_tokens * hidden, 4096)
        self.pool = PinnedPool(box_bytes, len(self.layers), pin=device.type == "cuda", background=False)
        self._box = {layer: i for i, layer in enumerate(self.layers)}
        self.boxes = [self.pool.slot(i) for i in range(len(self.layers))]  # uint8 [box_bytes] each
        self.header_words = [b[:HEADER].view(torch.int64) for b in self.boxes]  # [8] int64 each (kernel arguments)
        self.headers = [w.numpy() for w in self.header_words]  # the same words, read and written by the host
        for h in self.headers:
            h[:] = 0
        self.addresses = np.ascontiguousarray(addresses, dtype=np.int64)
        self.log = np.zeros(log_entries * LOG_ENTRY, dtype=np.uint8)
        rows = self.log.reshape(log_entries, LOG_ENTRY)
        self._log_heads, self._log_codes = rows[:, 8:16].view(np.int32), rows[:, 16:].view(np.int32)  # [n, 2], [n, 256]
        # experts, bytes, kernel ns, layers served, log head, GPU-gap ns, gaps, serving ns, when the latest step's
        # first layer was seen and its latest layer answered (monotonic ns), the GPU's waits: layers read, layers it
        # waited in, its reads of `done` in them, then the ns between steps, how many, and how many pauses (gaps over
        # 5 ms, left out) (csrc/cpu_mailbox.cpp)
        self.counters = np.zeros(16, dtype=np.int64)
        self._log_tail = 0
        self.log_lost = 0
        # the experts' format: csrc/cpu_mailbox.cpp's cfg [12:19] (format code, fp8 block or GGUF's up offset, the
        # offsets of the scales and of gate_up's values, a gate and an up row's bytes)
        fmt = [0, 1, 1, 0, 0, 0, 4 * hidden]
        if layout is not None and layout.fmt.quantized:
            gu_bytes, payload = layout.down.offset, layout.payload_bytes
            up = layout_up_offset(layout.fmt, hidden, inter) if layout.fmt.kind == "gguf" else 0
            fmt = [*format_args(layout.fmt, up), layout.gate_up_scales.offset, layout.down_scales.offset,
                   layout.gate_up.offset, layout.gate_up.nbytes // inter]
        kind = layout.fmt.kind if layout is not None else "plain"
        cfg = np.array([hidden, addresses.shape[1], inter, gu_bytes, self.out_off, payload, self.max_pairs,
                        ce.isa_code(cpu_kernel, kind), threads, SPIN_NS, len(self.layers), log_entries, *fmt],
                       dtype=np.int64)
        box_addr = np.array([b.data_ptr() for b in self.boxes], dtype=np.int64)
        layer_ids = np.array(self.layers, dtype=np.int32)
        self._keep = (cfg, box_addr, layer_ids, acts, biases, tables)
        self.handle = ce.start_mailbox(cfg, box_addr, layer_ids, self.addresses, self.log, self.counters, acts, biases)
        if not self.handle:
            self.pool.close()
            raise RuntimeError("the CPU expert kernel is not available: no mailbox worker")
        # an engine dropped without close(): the worker stops when this is collected (it holds what the thread reads)
        self._ahead_keep: list = []  # what the worker's warm-ahead reads (`warm_ahead`), held as long as the worker
        self._finalizer = weakref.finalize(self, ce.stop_mailbox, self.handle, self._keep, self.addresses, self.log,
                                           self.counters, self.pool, self._ahead_keep)
        self.gen = torch.zeros(1, dtype=torch.int64, device=device)  # the step's generation (device side)
        self._begun = False  # `begin_step(early=True)` ran for the step being built
        self._host_gen = 0  # the same on the CPU-only path
        self._shapes: dict[tuple[int, int], torch.Tensor] = {}  # (N, k) -> int32 [4] on the device
        self._all_rows: dict[int, torch.Tensor] = {}  # P -> int32 [P] of I: every cold pair's whole expert here
        # the inbox and the share's split packed by one kernel (`mailbox_pack`); False once it failed to build: then
        # torch ops pack them
        self.fused = True
        # no copy node on a layer's path: the fused pack posts the inbox itself and one kernel fetches the answer;
        # False where that cannot run (no Triton, or its kernels failed to build): then three copy nodes a layer
        self.direct = device.type == "cuda" and mailbox_pack.triton is not None
        self._direct_checked = False
        self._counts = torch.zeros(len(self.layers), dtype=torch.int32, device=device)  # the pack's programs done

    # ---- the device side: ops a decode graph captures -------------------------------------------------
    def begin_step(self, early: bool = False) -> None:
        """A new step: the generation every layer's mailbox is answered with (call once, before its layers).
        `early`: called ahead of the first layer's own call (warm-ahead's plan, on another stream, reads the
        generation), which then does nothing."""
        if self._begun:
            self._begun = False
            return
        self._begun = early
        if self.device.type == "cuda":
            self.gen.add_(1)
        else:
            self._host_gen += 1

    def self_test(self, max_spins: int = 2_000_000) -> str | None:
        """One round trip with nothing to compute, outside any graph: None when the GPU saw the worker's answer,
        else why not (a host whose GPU cannot poll page-locked memory would otherwise stall every layer of
        the first step for the whole `MAX_SPINS`). Its log entry is dropped."""
        layer = self.layers[0]
        k = self.top_k
        self.begin_step()
        dev = self.device
        self.exchange(layer, torch.zeros(k, dtype=torch.int64, device=dev), torch.zeros(k, dtype=torch.int32, device=dev),
                      torch.zeros(1, self.hidden, device=dev), torch.zeros(1, k, device=dev), max_spins=max_spins)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.drain()
        hdr = self.headers[0]
        if hdr[3] != 0 or hdr[1] != hdr[0]:
            return "the GPU did not see the CPU worker's answer in page-locked memory"
        return None

    def exchange(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 weights: torch.Tensor, gpu_work=None, max_spins: int | None = None,
                 rows: torch.Tensor | None = None, share: GpuShare | None = None,
                 zero: torch.Tensor | None = None) -> torch.Tensor:
        """Send one layer's pairs (experts [P], slots [P] int32: -1 cold, for the worker; -2 cold, the GPU's),
        x [N, H] and weights [N, k] to the worker; returns its partial sum [N, H] fp32 on x's device (the stream
        waits for it). rows [P] int32: of each worker pair, how many of its expert's leading intermediate rows the
        worker computes (None: all I). Given a `GpuShare`, it cuts the cold pairs between the worker and the
        GPU instead. `gpu_work(addr, rows)` (on CUDA) is enqueued once the layer is posted, so it runs while the
        worker does: addr [P] int64 is the share's split (0: no GPU part; None without a share), rows the worker's
        rows of each pair.
        zero: a contiguous fp32 buffer (the GPU's pair outputs, which `gpu_work` fills) that is zeroed before
        `gpu_work` runs, by the fused pack's own kernel where it runs (no memset node on the layer's path)."""
        n, k = weights.shape
        if n > self.max_tokens or k != self.top_k:
            raise ValueError(f"mailbox holds {self.max_tokens} tokens of top-{self.top_k}, got {n} of top-{k}")
        x_off, nbytes = inbox_layout(n, k, self.hidden)
        if self.device.type != "cuda":  # tests, CPU hosts: packed in place, awaited from Python
            if zero is not None:
                zero.zero_()
            return self._exchange_host(layer, experts, slots, x, weights, x_off, nbytes, rows, share)
        from strata.kernels.gpu.host_signal import MAX_SPINS, wait_for_host

        i, spins = self._box[layer], MAX_SPINS if max_spins is None else max_spins
        if self.direct and rows is None:
            out = self._exchange_direct(i, experts, slots, x, weights, x_off, nbytes, gpu_work, spins, share, zero)
            if out is not None:
                return out
        # the fallback: the inbox packed on the device, then copy nodes for it, `ready` and the answer
        box = self.boxes[i]
        out_box = torch.empty(nbytes, dtype=torch.uint8, device=x.device)  # the inbox, packed on the device
        packed = None if rows is not None else self._pack_fused(out_box, layer, experts, slots, x, weights, x_off,
                                                                 share, zero=zero)
        if packed is None:  # the torch ops
            if zero is not None:
                zero.zero_()
            slots, *packed = self._split(layer, experts, slots, rows, share)
            pack_inbox(out_box, self._shape(n, k, x.device), experts, slots, packed[1], x, weights, x_off)
        box[HEADER : HEADER + nbytes].copy_(out_box, non_blocking=True)
        box[:8].copy_(self.gen.view(torch.uint8), non_blocking=True)  # ready: after the inbox (stream order)
        if gpu_work is not None:
            gpu_work(*packed)
        h = self.header_words[i]
        wait_for_host(h[1:2], self.gen, h[3:4], h[4:5], spins)
        out = torch.empty(n * self.hidden, dtype=torch.float32, device=x.device)
        out.copy_(box[self.out_off : self.out_off + 4 * n * self.hidden].view(torch.float32), non_blocking=True)
        return out.view(n, self.hidden)

    def take_direct_exchange(self) -> None:
        """Take the direct exchange from now, its fetch kernel's check counted as passed: for recording its launches
        where no GPU runs them (strata.runtime.offload.decode_builds). On CUDA, `exchange` decides and checks this
        itself."""
        self.direct, self._direct_checked = True, True

    def exchange_direct(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                        weights: torch.Tensor, gpu_work=None, max_spins: int | None = None, share: GpuShare | None = None,
                        zero: torch.Tensor | None = None) -> torch.Tensor | None:
        """`exchange`'s path on CUDA while `direct`, whatever this mailbox's device (same arguments): the fused pack
        writes the inbox into the page-locked mailbox and posts it, one kernel waits for the worker and fetches its
        partial sum [N, H] fp32. None where its kernels failed to build."""
        from strata.kernels.gpu.host_signal import MAX_SPINS

        n, k = weights.shape
        x_off, nbytes = inbox_layout(n, k, self.hidden)
        return self._exchange_direct(self._box[layer], experts, slots, x, weights, x_off, nbytes, gpu_work,
                                     MAX_SPINS if max_spins is None else max_spins, share, zero)

    def _exchange_direct(self, i, experts, slots, x, weights, x_off, nbytes, gpu_work, spins, share, zero=None):
        """`exchange` with no copy node: the fused pack writes the inbox into the page-locked mailbox and posts
        `ready` itself; one kernel waits for `done` and fetches the answer. None where its kernels failed to
        build in the eager warm-up (then the copies from now)."""
        from strata.kernels.gpu.host_signal import wait_and_fetch

        layer, box, n = self.layers[i], self.boxes[i], x.shape[0]
        src = box[self.out_off : self.out_off + 4 * n * self.hidden].view(torch.float32)
        out = torch.empty(n * self.hidden, dtype=torch.float32, device=x.device)
        try:
            if not self._direct_checked:  # the fetch kernel built before anything is posted (no half-sent layer):
                # `self_test` runs this first, eagerly; done equals the generation given, so it returns at once
                wait_and_fetch(self.header_words[i], self.header_words[i][1:2].to(x.device), src, out, spins)
                torch.cuda.synchronize(x.device)
                self._direct_checked = True
            packed = self._pack_fused(box[HEADER : HEADER + nbytes], layer, experts, slots, x, weights, x_off, share,
                                      ready=(self.header_words[i], self.gen, self._counts[i : i + 1]), zero=zero)
        except Exception as e:  # a Triton that cannot build them: found in the eager warm-up, before any capture
            if torch.cuda.is_current_stream_capturing():
                raise
            log.warning("strata: the mailbox's direct exchange failed (%s); copying through the device", e)
            self.direct = False
            return None
        if gpu_work is not None:
            gpu_work(*packed)
        wait_and_fetch(self.header_words[i], self.gen, src, out, spins)
        return out.view(n, self.hidden)

    def _pack_fused(self, out_box, layer, experts, slots, x, weights, x_off, share, ready=None, zero=None):
        """The share's split and the inbox in one kernel (~35 small ops otherwise): (addr [P] or None, rows [P]), or
        None where it cannot run (no Triton, or it failed to build: then the torch ops from now). `ready`: see
        `mailbox_pack.pack_mailbox` (its errors are the caller's)."""
        if not (self.fused and mailbox_pack.available(x)):
            return None
        p = experts.numel()
        rows = torch.empty(p, dtype=torch.int32, device=x.device)
        addr = torch.empty(p, dtype=torch.int64, device=x.device) if share is not None else None
        try:
            mailbox_pack.pack_mailbox(out_box, experts.reshape(-1), slots.reshape(-1), x, weights, x_off, self.inter,
                                      share, layer, rows=rows, addr=addr, ready=ready, zero=zero)
        except Exception as e:
            if ready is not None:
                raise  # a Triton that cannot build it: found in the eager warm-up, before any capture
            if torch.cuda.is_current_stream_capturing():
                raise
            log.warning("strata: the fused mailbox pack failed (%s); packing with torch ops", e)
            self.fused = False
            return None
        return addr, rows

    def _split(self, layer, experts, slots, rows, share):
        """The torch ops' (slots, addr or None, rows): the share's split, else `rows` or every cold row."""
        if share is not None:
            return share.assign(layer, experts, slots)
        if rows is None:
            p = experts.numel()
            rows = self._all_rows.get(p)
            if rows is None:  # made in the eager warm-up run before a capture, reused by the graph
                rows = self._all_rows[p] = torch.full((p,), self.inter, dtype=torch.int32, device=experts.device)
        return slots, None, rows

    def _shape(self, n: int, k: int, device) -> torch.Tensor:
        """int32 [4] (N, k, P, 0) on the device: made in the eager warm-up run before a capture, reused by it."""
        shape = self._shapes.get((n, k))
        if shape is None:
            shape = self._shapes[(n, k)] = torch.tensor([n, k, n * k, 0], dtype=torch.int32, device=device)
        return shape

    def _exchange_host(self, layer, experts, slots, x, weights, x_off, nbytes, rows, share) -> torch.Tensor:
        """`exchange` without a GPU (tests, CPU hosts): the same mailbox written and awaited from Python."""
        n, k = weights.shape
        box, hdr = self.boxes[self._box[layer]], self.headers[self._box[layer]]
        slots, _, rows = self._split(layer, experts, slots, rows, share)
        pack_inbox(box[HEADER : HEADER + nbytes], self._shape(n, k, x.device), experts, slots, rows, x, weights, x_off)
        gen = self._host_gen
        hdr[0] = gen  # after the inbox (program order; x86 keeps stores in order)
        spins = 0
        while hdr[1] != gen:
            spins += 1
        hdr[4] = spins  # as the GPU's acquire kernel does: the worker reads it once the next layer is posted
        self.check()
        return box[self.out_off : self.out_off + 4 * n * self.hidden].view(torch.float32).clone().view(n, self.hidden)

    # ---- the host side, between steps --------------------------------------------------------------
    def warm_ahead(self, next_of: dict[int, int], plans: torch.Tensor, slots: int, nbytes: int) -> np.ndarray | None:
        """Have the worker read ahead, once it has answered layer l, the gate/up rows of the experts that warm-ahead's
        plan lists for `next_of[l]` (plans [2, 1 + slots] int64, page-locked, by the planned layer's parity:
        `strata.kernels.gpu.warm_plan`), up to `nbytes` a layer, each of its threads the rows the kernel will give it
        (csrc/cpu_mailbox.cpp, WarmCfg). Once per worker. Returns the worker's warm counters (int64 [8]: plans used,
        plans not ready, bytes read, ns reading, bytes of read rows computed, pieces another thread computed, ns and
        the longest ns a read waited for a thread of an earlier read still inside), None where it cannot."""
        from strata.kernels.cpu import experts as ce

        if not self.handle or self._ahead_keep:
            return None
        nxt = np.array([next_of.get(layer, -1) for layer in self.layers], dtype=np.int64)
        counters = np.zeros(8, dtype=np.int64)
        if ce.mailbox_warm(self.handle, nxt, plans.data_ptr(), slots, int(nbytes), counters) != 0:
            return None
        self._ahead_keep.extend((nxt, plans, counters))
        return counters

    def check(self) -> None:
        """Raise if the worker reported an error or the GPU gave up waiting for it."""
        for layer, hdr in zip(self.layers, self.headers, strict=True):
            if hdr[2] != 0:
                what = {-3: "an expert not resident in page-locked RAM", -4: "a malformed mailbox"}.get(int(hdr[2]))
                raise RuntimeError(f"CPU expert worker failed at layer {layer}: {what or f'kernel code {int(hdr[2])}'}")
            if hdr[3] != 0:
                raise RuntimeError(f"CPU expert worker did not answer layer {layer} (step {int(hdr[3])}): the decode "
                                   "step gave up waiting; set [debug] split_decode = \"host\" to work around it")

    def drain(self) -> list[tuple[int, list[int], list[int]]]:
        """(layer, resident experts, experts computed here) for each layer served since the last drain."""
        head = int(self.counters[4])
        cap = len(self.log) // LOG_ENTRY
        if head - self._log_tail > cap:
            self.log_lost += head - cap - self._log_tail
            self._log_tail = head - cap
        entries = []
        for seq in range(self._log_tail, head):  # plain ints from the start: numpy scalars cost ~1 us a comparison
            layer, n = self._log_heads[seq % cap].tolist()
            codes = self._log_codes[seq % cap, :n].tolist()
            entries.append((layer, [c for c in codes if c >= 0], [-c - 1 for c in codes if c < 0]))
        self._log_tail = head
        return entries

    def close(self) -> None:
        """Stop the worker (no graph may be replaying a step that waits for it) and free the mailboxes."""
        from strata.kernels.cpu import experts as ce

        if self.handle:
            self._finalizer.detach()
            ce.stop_mailbox(self.handle)
            self.handle = 0
            self._ahead_keep.clear()
            self.pool.close()


def pack_inbox(dst: torch.Tensor, shape, experts, slots, rows, x, weights, x_off: int) -> None:
    """The inbox layout (csrc/cpu_mailbox.cpp) written into uint8 `dst` with torch ops: int32 N, k, P, 0 (`shape`),
    experts [P], slots [P], rows [P]; fp32 x [N*H] at `x_off`; fp32 weights [P] after it. (On CUDA with Triton,
    `strata.kernels.gpu.mailbox_pack` writes the same in one kernel.)"""
    p, nh = experts.numel(), x.numel()
    ints = dst[: 16 + 12 * p].view(torch.int32)
    ints[:4].copy_(shape)
    ints[4 : 4 + p].copy_(experts.reshape(-1))
    ints[4 + p : 4 + 2 * p].copy_(slots.reshape(-1))
    ints[4 + 2 * p : 4 + 3 * p].copy_(rows.reshape(-1))
    dst[x_off : x_off + 4 * nh].view(torch.float32).copy_(x.reshape(-1))
    dst[x_off + 4 * nh : x_off + 4 * nh + 4 * p].view(torch.float32).copy_(weights.reshape(-1))

"""CPU expert compute of the tiered executor: cold experts run straight from pinned/host RAM on CPU threads.

`CpuCompute` is the part of `ExpertCompute` (strata.runtime.offload.expert_compute) that runs experts on the CPU: the
compiled kernel on experts held in pinned slots by address (`start_cpu`, a decode layer's share, possibly in the
background), through tier handles otherwise (`cpu_forward`), or the reference math (`cpu_numerics = "gpu"`);
`calibrate_cpu` starts the cost model from a measured rate. The kernel reads the store's format as stored (bf16, or
FP8 / MXFP4 values and scales where the store's layout puts them); rates count the format's bytes
(`ExpertLayout.payload_bytes`).
"""

from __future__ import annotations

import array
import math
import time

import numpy as np
import torch

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm, apply_experts, as_weights
from strata.kernels.quant import ExpertLayout, reads


class CpuCompute:
    """CPU expert compute, mixed into `ExpertCompute`, whose state it uses: `manager`, `rates`, `cpu_experts`,
    `cpu_threads`, `cpu_kernel`, `pin_results`, `pinned_sums`, `use_fast_cpu`, `split`, `form` and `gate_up_bias`."""

    def calibrate_cpu(self, nbytes: int = 256 << 20, rounds: int = 3) -> float:
        """Measure the CPU expert kernel on this model's expert shape and format (one token, about `nbytes` of
        weights: more than the CPU caches, little enough to take well under a second) and start the cost model from
        that rate instead of a guess; returns bytes/s of the format's bytes."""
        store = self.manager.store
        layout = store.layout
        (gu_shape, dn_shape), dtype = store.expert_shapes, store.dtype
        experts = max(2, min(16, nbytes // store.payload_bytes))
        # constant weights: the kernel is memory-bound, so values do not matter and filling is cheap (a constant byte
        # in quantized blobs: finite FP8 values and scales, mid-range e8m0 scales; GGUF's header names real types)
        if self._kernel_reads(layout):
            from strata.kernels.cpu.expert_args import calibration_blob

            ws = [layout.matrices(calibration_blob(layout)) for _ in range(experts)]
            dtype = torch.bfloat16
        else:
            dtype = torch.bfloat16 if layout.fmt.quantized else dtype
            ws = [(torch.full(gu_shape, 0.01, dtype=dtype), torch.full(dn_shape, 0.01, dtype=dtype))
                  for _ in range(experts)]
        x = torch.full((1, gu_shape[1]), 0.5, dtype=dtype)
        groups = [(e, torch.tensor([e])) for e in range(experts)]  # pair e = token 0's e-th expert
        by_expert = dict(enumerate(ws))
        out = torch.zeros(x.shape, dtype=torch.float32)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            _cpu_apply(x, torch.ones(1, experts), experts, groups, by_expert, out, self.use_fast_cpu, self.cpu_threads,
                       self.cpu_kernel)
            best = min(best, time.perf_counter() - t0)
        nbytes = experts * (layout.payload_bytes if self._kernel_reads(layout) else ws[0][0].nbytes + ws[0][1].nbytes)
        self.rates.cpu_bytes_per_s = nbytes / best
        return self.rates.cpu_bytes_per_s

    @property
    def hands_off(self) -> bool:
        """Whether a bf16 expert with many tokens goes from the CPU kernel to torch's GEMMs (on AMX:
        `cpu_experts.plain_max_tokens`; a quantized one, dequantized: `quant_max_tokens`). Only where the CPU computes
        every expert: beside a GPU the cost model gives the CPU a prompt's few-token experts alone, which one kernel
        call over all of them computes faster than torch's GEMMs one expert at a time (on an H100 host's AMX Xeon, the
        bench model's 512-token prefill at a 25% budget took 0.534 s with the hand-off against 0.386 s without:
        docs/benchmarks.md, "The tree on an H100: every GPU test, ...")."""
        return not self.split

    def _kernel_reads(self, layout: ExpertLayout) -> bool:
        """Whether the compiled kernel reads experts of `layout` as stored: FP8 and MXFP4 (`FAST_PATHS`), on the
        kernel path (not the reference math)."""
        return layout.fmt.quantized and self.use_fast_cpu and reads("cpu_kernel", layout.fmt)

    def cpu_forward(self, layer: int, x: torch.Tensor, weights: torch.Tensor, k: int, groups) -> torch.Tensor:
        """Experts of `groups` [(expert, its pair indices: int64 tensor or array)] from host RAM on the CPU:
        x [N, H] on the CPU -> partial sum [N, H] fp32."""
        if self.use_fast_cpu:
            out = self._cpu_packed(layer, x, weights, k, groups)
            if out is not None:
                return out
        groups = [(e, torch.as_tensor(sel)) for e, sel in groups]
        out = torch.zeros(x.shape, dtype=torch.float32, pin_memory=self.pin_results)
        chunk = self.manager.max_acquire("cpu")
        seconds, nbytes = 0.0, 0
        store = self.manager.store
        # a quantized format: the kernel reads it as stored (QuantMatrix views of the slots); where it does not (the
        # reference math, or a format it does not read) each expert is dequantized to fp32
        quantized = store.expert_format.quantized
        dequantize = quantized and not self._kernel_reads(store.layout)
        for i in range(0, len(groups), chunk):
            part = groups[i : i + chunk]
            handles = self.manager.acquire([(layer, e) for e, _ in part], "cpu")
            try:
                by_expert = {h.key[1]: h.weights(torch.float32) if dequantize else h.matrices if quantized
                             else (h.gate_up, h.down) for h in handles}
                nbytes += len(handles) * store.payload_bytes
                t0 = time.perf_counter()
                _cpu_apply(x, weights, k, part, by_expert, out, self.use_fast_cpu and not dequantize, self.cpu_threads,
                           self.cpu_kernel, self.form, self.gate_up_bias(layer, torch.device("cpu")), self.hands_off)
                seconds += time.perf_counter() - t0
            finally:
                self.manager.release(handles)
        self.cpu_experts += len(groups)
        # the kernel's own rate: waits for experts still on their way to RAM are stalls, counted by the manager,
        # and must not make the cost model believe the CPU is slow (it would then never try it again)
        self.rates.observe_cpu(nbytes, seconds)
        return out

    def cpu_rows(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 residual: torch.Tensor | None) -> torch.Tensor | None:
        """A CPU-only host's decode layer once every expert sits in pinned RAM for good: x [N, H] bf16, the router's
        ids and weights [N, k] -> residual + the routed experts' sum [N, H] bf16, in one compiled call
        (strata.kernels.cpu.expert_rows), equal bit for bit to the grouped path's. None where it does not apply
        (experts still arriving, a GPU tier, the reference math, biases or a SwiGLU form, a format the kernel does
        not read, more tokens than the kernel takes an expert): the grouped path then runs."""
        from strata.kernels.cpu.expert_rows import MAX_ROWS

        if not self.use_fast_cpu or self.device_tier != "cpu" or x.shape[0] > MAX_ROWS:
            return None
        if self._pinned_layers is None:
            if not self.manager.all_pinned():
                return None  # asked again next step
            self._pinned_layers = self._build_pinned_layers()
        layers, most = self._pinned_layers
        target = layers.get(layer)
        if target is None or x.shape[0] > most:  # (past `most` tokens an expert goes to torch's GEMMs)
            return None
        t0 = time.perf_counter()
        got = target.forward(x, ids, weights, residual, self.cpu_threads)
        if got is None:
            return None
        y, experts = got
        self.manager.note_pinned_reads(layer, set(ids.reshape(-1).tolist()))
        self.cpu_experts += experts
        self.rates.observe_cpu(experts * self.manager.store.payload_bytes, time.perf_counter() - t0)
        return y

    def _build_pinned_layers(self) -> tuple[dict, int]:
        """(layer -> PinnedLayer over the pinned slots' addresses, which never change again; the most tokens a call
        takes), or ({}, 0) where `cpu_rows` never applies."""
        from strata.kernels.cpu import experts as ce
        from strata.kernels.cpu.expert_rows import PinnedLayer

        store = self.manager.store
        layout = store.layout
        fmt = layout.fmt if layout.fmt.quantized else None
        if not self.plain_math or (fmt is None and store.dtype != torch.bfloat16) \
                or (fmt is not None and not self._kernel_reads(layout)):
            return {}, 0
        addresses = np.zeros((max(self.moe_layers, default=-1) + 1, store.index.num_experts), dtype=np.int64)
        for (layer, e), address in self.manager.pinned_addresses().items():
            addresses[layer, e] = address
        layers = {}
        for layer in self.moe_layers:
            target = PinnedLayer.build(addresses[layer], layout, self.cpu_kernel)
            if target is None:
                return {}, 0
            layers[layer] = target
        backend = ce.backend(self.cpu_kernel, layout.fmt)
        return layers, (ce.quant_max_tokens(backend, fmt.kind, self.hands_off) if fmt is not None
                        else ce.plain_max_tokens(backend, self.hands_off))

    def _cpu_packed(self, layer: int, x: torch.Tensor, weights: torch.Tensor, k: int, groups) -> torch.Tensor | None:
        """`cpu_forward` for experts resident in pinned RAM, with the kernel reading their slots by address:
        no handles, views or per-expert checks (a decode layer's CPU share spent ~0.3 ms on those). Same
        kernel call, same expert order, so the same result; None when this path does not apply."""
        work = self.start_cpu(layer, x, weights, k, groups, background=False)
        return work.wait() if work is not None else None

    def start_cpu(self, layer: int, x: torch.Tensor, weights: torch.Tensor, k: int, groups,
                  background: bool = True) -> CpuShare | None:
        """Start the CPU share of a decode layer on experts resident in pinned RAM; `wait()` gives the partial
        sum [N, H] fp32. In the background (the kernel's launcher thread) when `background` and the kernel
        is free, else now. The kernel reads each expert's values (and FP8 / MXFP4 scales) where the store's layout
        puts them in the slot. None when the experts are not all in pinned RAM (or in a format the kernel does not
        read: plain other than bf16, or too many tokens)."""
        from strata.kernels.cpu import experts as ce
        from strata.kernels.cpu.expert_args import bias_rows, slot_pointers

        store = self.manager.store
        layout = store.layout
        fmt = layout.fmt if layout.fmt.quantized else None
        backend = ce.backend(self.cpu_kernel, layout.fmt)
        if (fmt is None and store.dtype != torch.bfloat16) or (fmt is not None and not self._kernel_reads(layout)) \
                or backend == "torch" or not groups:
            return None
        # pair indices per expert as numpy (a decode layer's host step spends microseconds, not a torch op, on each)
        sels = [np.asarray(sel, dtype=np.int64) for _, sel in groups]
        most = (ce.quant_max_tokens(backend, fmt.kind, self.hands_off) if fmt is not None
                else ce.plain_max_tokens(backend, self.hands_off))
        if max(len(sel) for sel in sels) > most:
            return None
        keys = [(layer, e) for e, _ in groups]
        slots = self.manager.hold_resident(keys)
        if slots is None:
            return None
        try:
            rows = np.concatenate(sels)  # [P] pair indices, expert by expert
            tok = torch.from_numpy(rows // k)  # [P] int64 token row of each pair
            w = torch.from_numpy(weights.float().numpy().reshape(-1)[rows])  # [P] fp32 its routing weight (a copy)
            x32 = x.float().contiguous()
            inter = store.expert_shapes[1][1]
            meta, scales, off = array.array("q"), array.array("q"), 0
            tok_ptr, w_ptr, slot_address = tok.data_ptr(), w.data_ptr(), self.manager.pool.slot_address
            for sel, slot in zip(sels, slots, strict=True):
                gu, dn, gus, dns = slot_pointers(layout, slot_address(slot))
                meta.extend((gu, dn, tok_ptr + 8 * off, w_ptr + 4 * off, len(sel), inter, inter))
                scales.extend((gus, dns))
                off += len(sel)
            # a share (background) is uploaded through CpuShare.copy_to, which keeps its reused buffer's turn
            sums = self.pinned_sums if background and self.pin_results else None
            index, out = sums.take(x.shape) if sums is not None else \
                (-1, torch.zeros(x.shape, dtype=torch.float32, pin_memory=self.pin_results))
            bias = self.gate_up_bias(layer, torch.device("cpu"))  # gpt-oss: [E, 2I] fp32, each expert's row read
            bias_at, _ = bias_rows(bias, [e for e, _ in groups], inter) if bias is not None else (None, None)
            packed = {"backend": self.cpu_kernel, "fmt": fmt, "scales": scales if fmt is not None else None,
                      "form": self.form, "gate_up_bias": bias_at}
            call = ce.start_packed(x32, meta, out, self.cpu_threads, **packed) if background else None
            t0 = time.perf_counter()
            if call is None:
                ce.run_packed(x32, meta, out, self.cpu_threads, **packed)
        except BaseException:
            self.manager.drop_held(keys)
            raise
        seconds = time.perf_counter() - t0

        def finish() -> torch.Tensor:
            try:
                kernel_s = call.wait() if call is not None else seconds
            finally:
                self.manager.drop_held(keys)
            self.cpu_experts += len(groups)
            self.rates.observe_cpu(len(groups) * layout.payload_bytes, kernel_s)
            return out

        return CpuShare(finish, (tok, w, x32, scales, bias_at), sums, index)


class PinnedSums:
    """Pinned buffers for the CPU shares' partial sums [N, H] fp32, handed out in turn and reused.

    A fresh pinned tensor a share (`torch.zeros(..., pin_memory=True)`: an allocation and a fill a layer) was 10-16% of
    the scheduler thread in a short prompt's prefill at a 25% budget on H100 hosts (docs/benchmarks.md, "a short
    prompt's CPU share uploaded without a wait"). One thread's shares use it, each uploaded (`CpuShare.copy_to`) or
    dropped before the share `depth` after it starts; a buffer is handed out again once the GPU copy that read it is
    done."""

    def __init__(self, depth: int = 2, pin: bool = True):
        self._pin = pin  # False: plain memory (a host without CUDA, tests)
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._read: list[torch.cuda.Event | None] = [None] * depth  # the last copy out of each buffer
        self._next = 0

    def take(self, shape: torch.Size) -> tuple[int, torch.Tensor]:
        """(a buffer's index, a zeroed pinned fp32 tensor of `shape` in it)."""
        i, n = self._next, math.prod(shape)
        self._next = (i + 1) % len(self._buffers)
        read, self._read[i] = self._read[i], None
        if read is not None:
            read.synchronize()  # long done as a rule: the layers since have waited for the GPU
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            buf = self._buffers[i] = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())),
                                                 dtype=torch.float32, pin_memory=self._pin)
        out = buf[:n].view(shape)
        # one thread's memset: right after a kernel call torch's `zero_()` waits for its idle intra-op threads (665
        # against 42 us for [64, 2048] on two Zen 4 cores: bench/probes/after_kernel.py); on an H100 host the memset
        # made a 64-token prompt's split prefill 1.23-1.29x faster (docs/benchmarks.md, "a short prompt's split
        # without its second sync")
        out.numpy().fill(0.0)
        return i, out

    def read_on(self, i: int, stream: torch.cuda.Stream) -> None:
        """A copy out of buffer `i` was just issued on `stream`."""
        event = torch.cuda.Event()
        event.record(stream)
        self._read[i] = event


class CpuShare:
    """A layer's CPU share, started by `ExpertCompute.start_cpu`; `wait()` -> partial sum [N, H] fp32, `copy_to` /
    `to` put it on the GPU."""

    def __init__(self, finish, keep: tuple, sums: PinnedSums | None = None, index: int = -1):
        self._finish, self._keep, self._out = finish, keep, None  # keep: what the kernel reads until done
        self._sums, self._index = sums, index  # where the sum lives, if in a PinnedSums buffer

    @classmethod
    def done(cls, out: torch.Tensor) -> CpuShare:
        """A share already computed: its partial sum `out`."""
        share = cls(None, ())
        share._out = out
        return share

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._out, self._finish, self._keep = self._finish(), None, ()
        return self._out

    def copy_to(self, dst: torch.Tensor) -> torch.Tensor:
        """`wait()`, then the partial sum copied into `dst` (of its shape, on the GPU: queued behind the GPU's work
        where the sum is pinned, the host going on); returns dst."""
        src = self.wait()
        dst.copy_(src, non_blocking=src.is_pinned())
        if self._sums is not None and dst.is_cuda:
            self._sums.read_on(self._index, torch.cuda.current_stream(dst.device))
        return dst

    def to(self, device: torch.device) -> torch.Tensor:
        """The partial sum on `device` (`copy_to` a new tensor)."""
        src = self.wait()
        return self.copy_to(torch.empty(src.shape, dtype=src.dtype, device=device))


def _cpu_apply(x, weights, k, groups, by_expert, out, fast: bool, threads: int | None = None,
               backend: str | None = None, form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None,
               hand_off: bool = True) -> None:
    """One chunk of CPU experts, added into out: the compiled kernel (`backend`: its instruction set; `hand_off`:
    `cpu_experts_forward`'s), or the reference math (`form`, `gate_up_bias` [E, 2I]: the experts' SwiGLU and biases;
    no down bias)."""
    if fast:
        from strata.kernels.cpu.experts import cpu_experts_forward

        flat_w = weights.reshape(-1).float()
        ids = None if gate_up_bias is None else [e for e, _ in groups]  # each expert's bias row
        cpu_experts_forward(x, [by_expert[e] for e, _ in groups], [sel // k for _, sel in groups],
                            [flat_w[sel] for _, sel in groups], out=out, threads=threads, backend=backend, form=form,
                            gate_up_bias=gate_up_bias, expert_ids=ids, hand_off=hand_off)
        return

    def fp32_expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(w.float() for w in as_weights(by_expert[e], torch.float32))

    apply_experts(x.float(), weights.float(), k, groups, fp32_expert, out=out, form=form, gate_up_bias=gate_up_bias)

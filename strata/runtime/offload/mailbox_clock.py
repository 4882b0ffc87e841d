"""What the mailbox worker's own counters say (`CpuMailbox` inherits these readings): its layers' trips on its clock,
its kernel's rate, and how often the GPU waited for its answers (csrc/cpu_mailbox.cpp's counters)."""

from __future__ import annotations

import numpy as np


class WorkerClock:
    """Readings of the running worker's counters; the host class holds `counters` (int64 [16], written by the
    worker) and `headers` (each layer's mailbox header, int64 [8])."""

    counters: np.ndarray
    headers: list[np.ndarray]

    @property
    def experts_computed(self) -> int:
        return int(self.counters[0])

    def timing(self) -> dict:
        """Where a layer's trip goes, from the worker's clock: `serve_us` from seeing a layer's `ready` to writing
        its `done` (the CPU share, its kernel `kernel_us` among it), `gpu_gap_us` from one layer's `done` to the
        next layer's `ready` within a step (the GPU's own work between two CPU shares: the rest of the layer,
        the next one's attention and routing, the copies), per layer served; `step_gap_us` the same from a step's
        last layer to the next step's first (the LM head, sampling, the launch, the first attention; gaps over 5 ms,
        pauses in decode, are left out and counted in `totals["pauses"]`); `gpu_waited`, of the layers the worker
        computed some of, the fraction in which the GPU found no answer yet when it came for it (`gpu_waits`);
        `gpu_wait_reads`, the GPU's reads of `done` while it waited for the worker, per layer of the last step (0:
        the worker had answered). These average over every layer since the worker started (warm-up and prefill
        included); `totals` holds the running sums (ns, counts, kernel bytes), so a caller can average a window of
        its own from two readings (`window`)."""
        c = self.counters
        totals = {"layers": int(c[3]), "serve_ns": int(c[7]), "kernel_ns": int(c[2]), "gaps": int(c[6]),
                  "gap_ns": int(c[5]), "bytes": int(c[1]), "waits": int(c[10]), "waited": int(c[11]),
                  "step_gaps": int(c[14]), "step_gap_ns": int(c[13]), "pauses": int(c[15])}
        avg = self.window({}, totals) or {}  # since the worker started
        return {"layers": totals["layers"], "serve_us": avg.get("serve_us", 0.0), "kernel_us": avg.get("kernel_us", 0.0),
                "gpu_gap_us": avg.get("gpu_gap_us") or 0.0, "gpu_waited": avg.get("gpu_waited"),
                "step_gap_us": avg.get("step_gap_us"),
                "gpu_wait_reads": round(float(np.mean([h[4] for h in self.headers])), 1), "totals": totals}

    @staticmethod
    def window(before: dict, after: dict) -> dict | None:
        """`timing()`'s per-layer figures over the layers served between two readings of its `totals` (None when
        none were): serve_us, kernel_us, gpu_gap_us, the kernel's GB/s, gpu_waited and step_gap_us (None where not
        read)."""
        d = {k: after[k] - before.get(k, 0) for k in after}
        if d["layers"] <= 0:
            return None
        waited = round(d["waited"] / d["waits"], 3) if d.get("waits", 0) > 0 else None
        step_gap = round(d["step_gap_ns"] / d["step_gaps"] / 1e3, 1) if d.get("step_gaps", 0) > 0 else None
        return {"layers": d["layers"], "serve_us": round(d["serve_ns"] / d["layers"] / 1e3, 1), "gpu_waited": waited,
                "step_gap_us": step_gap,
                "kernel_us": round(d["kernel_ns"] / d["layers"] / 1e3, 1),
                "gpu_gap_us": round(d["gap_ns"] / d["gaps"] / 1e3, 1) if d["gaps"] > 0 else None,
                # three significant figures: a test's tiny experts read well below 0.05 GB/s, which one decimal zeroes
                "kernel_GB_s": float(f"{d['bytes'] / d['kernel_ns']:.3g}") if d["kernel_ns"] > 0 else None}

    def kernel_rate(self) -> tuple[int, float]:
        """(bytes, seconds) the worker's kernel calls read and took so far."""
        return int(self.counters[1]), float(self.counters[2]) / 1e9

    def gpu_waits(self) -> tuple[int, int]:
        """(layers, waited) so far: of the layers the worker computed some of (the step's last one read once the next
        step posts), how many the GPU's wait was read for, and in how many of them it found no answer yet."""
        return int(self.counters[10]), int(self.counters[11])

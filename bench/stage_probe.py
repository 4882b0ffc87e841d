"""What a split decode layer's host calls cost on this machine: microseconds per call, idle and while the CPU
expert kernel runs (as it does during a split layer's copy staging).

    python bench/stage_probe.py --model DIR [--budget 3.6GiB] [--threads 12] [--out DIR]

On the H200 box staging a copy cost ~130-185 us of host time inside split decode, against 6-12 us for the
same bookkeeping on the development box (bench/RESULTS.md, eighth session): this times each piece of that
path (CUDA events, stream waits, one 9.4 MB copy, a small upload, the round trip to the host, `stream_gpu`,
`stage_gpu`) alone, so the expensive one shows. Writes stage_probe.json.
"""

from __future__ import annotations

import argparse
import array
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch


def timed(fn, n: int = 100) -> dict:
    """Median and 90th percentile host microseconds of `fn()` over n calls (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    us = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        us.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()  # each call starts from an idle queue, as a layer's host step does
    us.sort()
    return {"median_us": round(statistics.median(us), 1), "p90_us": round(us[int(0.9 * len(us))], 1)}


class CpuLoad:
    """The CPU expert kernel run back to back on `threads` threads over experts in pinned slots (a split
    layer's CPU share, ~4 experts), in a background thread, until stopped."""

    def __init__(self, m, threads: int, experts: int = 4):
        from strata.kernels import cpu_experts as ce

        store, pool = m.store, m.pool
        hidden, inter = store.expert_shapes[0][1], store.expert_shapes[1][1]
        self.x = torch.randn(1, hidden)
        self.out = torch.zeros(1, hidden)
        self.tok, self.w = torch.zeros(1, dtype=torch.int64), torch.ones(1)
        slots = list(m.pinned.slot_of.values())[:experts]
        self.meta = array.array("q")
        for s in slots:
            base = pool.slot_address(s)
            self.meta.extend((base, base + store.index.gate_up_bytes, self.tok.data_ptr(), self.w.data_ptr(), 1, inter, inter))
        self.ce, self.threads, self.stop, self.calls = ce, threads, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.ce.run_packed(self.x, self.meta, self.out, self.threads)
            self.calls += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def probes(engine, layer: int) -> dict:
    """name -> callable, each one piece of a split layer's host step."""
    from strata.runtime.step_io import to_host as _to_host
    from strata.runtime.step_io import upload as _upload

    m = engine.tiers
    slots = m.slots
    dev = slots.slab.device
    rows = slots.slab.unbind(0)
    pinned_slot = next(iter(m.pinned.slot_of.values()))
    src = m.pool.slot(pinned_slot)
    ev = torch.cuda.Event()
    ev.record()
    small = [torch.zeros(2, 16, dtype=torch.int32, device=dev), torch.zeros(2, 2048, device=dev), torch.zeros(2, 8, device=dev)]
    late = torch.zeros(16, dtype=torch.int32, device=dev)
    host16 = np.zeros(16, dtype=np.int32)

    def cold(n: int) -> list[int]:
        resident = m.resident_experts(layer, "gpu")
        return [e for e in range(m.store.index.num_experts) if e not in resident][:n]

    def event_record():
        torch.cuda.Event().record()

    def timing_event_record():
        torch.cuda.Event(enable_timing=True).record()

    def wait_event():
        torch.cuda.current_stream().wait_event(ev)

    def copy_9mb():
        with torch.cuda.stream(slots.copy_stream):
            rows[slots.num_slots - 1][: src.numel()].copy_(src, non_blocking=True)

    def upload_16():
        _upload(host16, late)

    def pin_small():
        torch.from_numpy(host16).pin_memory()

    def to_host_3():
        _to_host(*small)

    def stream_2():
        s = m.stream_gpu(layer, cold(2))
        if s is not None:
            s.wait()
            m.release_staged(s)

    def stage_2():
        s = m.stage_gpu(layer, cold(2))
        s.wait()
        m.release_staged(s)

    def note_hits_2():
        m.note_hits(layer, np.asarray(sorted(m.resident_experts(layer, "gpu"))[:2]))

    return {"event_record": event_record, "timing_event_record": timing_event_record, "wait_event": wait_event,
            "copy_9mb": copy_9mb, "upload_16": upload_16, "pin_small": pin_small, "to_host_3": to_host_3,
            "stream_gpu_2": stream_2, "stage_gpu_2": stage_2, "note_hits_2": note_hits_2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="3.6GiB")
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from strata import Engine

    cfg = {"tiers": {"gpu": {"budget": args.budget}}, "runtime": {"max_context": 1024}}
    engine = Engine.from_pretrained(args.model, config=cfg, device="cuda")
    engine.wait_settled()
    calls = probes(engine, layer=3)
    result: dict = {"idle": {}, "cpu_busy": {}}
    for name, fn in calls.items():
        result["idle"][name] = timed(fn)
    with CpuLoad(engine.tiers, args.threads) as load:
        time.sleep(0.1)
        for name, fn in calls.items():
            result["cpu_busy"][name] = timed(fn)
        result["cpu_busy"]["kernel_calls"] = load.calls
    print(json.dumps(result))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "stage_probe.json").write_text(json.dumps(result, indent=1))
    engine.close()


if __name__ == "__main__":
    main()

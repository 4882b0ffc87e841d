"""What one MoE layer's trip through the mailbox costs on the GPU box, by the number of cold experts it carries.

    python bench/mailbox_probe.py [--layers 12] [--threads 15] [--out DIR]

One-graph split decode (strata.runtime.cpu_mailbox) spends, per MoE layer: the copies into the mailbox, the
worker noticing, its CPU kernel, its answer, the GPU noticing, and the copy back. This captures `--layers`
exchanges in one CUDA graph (as a decode step does) with 0-8 of each layer's 8 pairs cold, on the bench
model's expert shape (Qwen3-30B-A3B: 2048 x 768 bf16, 9.4 MB), and reports microseconds per layer, the
worker kernel's own share of it and its GB/s: the fixed cost is the 0-cold row. Writes mailbox_probe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cuda (the probe) or cpu (a smoke run: eager, no graph)")
    ap.add_argument("--model", help="probe an engine's own mailbox and pinned experts instead (25%% GPU budget): "
                                    "the same experts every replay, then different ones every replay")
    args = ap.parse_args()
    if args.model:
        return engine_probe(args)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from strata.runtime.cpu_mailbox import CpuMailbox
    from strata.tiers.pinned import PinnedPool

    hidden, inter, k, experts = 2048, 768, 8, 8
    gu_bytes = 2 * inter * hidden * 2
    slot = -(-(gu_bytes + hidden * inter * 2) // 4096) * 4096
    pool = PinnedPool(slot, experts * args.layers, pin=cuda, background=False)  # distinct weights per layer: RAM, not cache
    for i in range(pool.num_slots):
        pool.slot(i).view(torch.bfloat16).fill_(0.01)
    addr = np.array([[pool.slot_address(layer * experts + e) for e in range(experts)] for layer in range(args.layers)])
    box = CpuMailbox(list(range(args.layers)), addr, hidden=hidden, inter=inter, gu_bytes=gu_bytes, payload=gu_bytes * 3 // 2,
                     top_k=k, max_tokens=1, threads=args.threads, device=dev)
    assert box.self_test() is None
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.full((1, k), 1 / k, device=dev)
    ids = torch.arange(k, device=dev)
    rows = []
    for cold in range(0, k + 1, 2):
        slots = torch.tensor([-1] * cold + [0] * (k - cold), dtype=torch.int32, device=dev)

        def step(slots=slots):
            box.begin_step()
            for layer in range(args.layers):
                box.exchange(layer, ids, slots, x, w)

        step()  # warm-up (compiles the wait kernel)
        sync()
        run = step
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            run = graph.replay
        sync()
        n0, (b0, s0) = box.experts_computed, box.kernel_rate()
        t0 = time.perf_counter()
        for _ in range(args.replays):
            run()
        sync()
        dt = time.perf_counter() - t0
        b1, s1 = box.kernel_rate()
        per_layer = dt / (args.replays * args.layers)
        kernel = (s1 - s0) / (args.replays * args.layers)
        rows.append({"cold_experts": cold, "us_per_layer": round(per_layer * 1e6, 1),
                     "kernel_us_per_layer": round(kernel * 1e6, 1), "outside_kernel_us": round((per_layer - kernel) * 1e6, 1),
                     "kernel_GB_s": round((b1 - b0) / (s1 - s0) / 1e9, 1) if s1 > s0 else None,
                     "experts_per_layer": round((box.experts_computed - n0) / (args.replays * args.layers), 2)})
        print(json.dumps(rows[-1]), flush=True)
        box.check()
    box.close()
    pool.close()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "mailbox_probe.json").write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


def engine_probe(args) -> None:
    """The worker kernel's rate on an engine's own pinned experts, outside decode (eager exchanges, nothing else
    running): is the kernel slower in the engine (its memory) or only while the engine decodes (interference)?"""
    from strata import Engine
    from strata.runtime.inspect import summarize_checkpoint

    budget = int(summarize_checkpoint(args.model).bytes_by_role["experts"] * 0.25)
    engine = Engine.from_pretrained(args.model, config={"tiers": {"gpu": {"budget": str(budget)}}}, device=args.device)
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(100 + i * 37) % vocab for i in range(128)]
    for seed in range(3):  # placement, warm-up, the mailbox opened
        engine.generate(prompt, max_tokens=16, temperature=1.0, seed=seed)
    box = engine._compute.mailbox
    if box is None:
        raise SystemExit(f"no mailbox: {engine.stats().get('one_graph_decode')}")
    dev, k = box.device, box.top_k
    rng = np.random.default_rng(0)
    pinned = [np.flatnonzero(box.addresses[layer]) for layer in box.layers]  # addresses: by model layer
    x = torch.randn(1, box.hidden, device=dev, dtype=torch.bfloat16)
    w = torch.full((1, k), 1 / k, device=dev)
    rows = []
    with torch.inference_mode():  # the mailbox's tensors are inference tensors (made in decode); not the engine's
        _engine_rows(box, pinned, x, w, k, dev, rng, rows, args.replays)  # (its transfer workers write its slots)
    box.check()
    engine.close()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "mailbox_engine_probe.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


def _engine_rows(box, pinned, x, w, k, dev, rng, rows: list, replays: int) -> None:
    """engine_probe's rows: the same, different, then the same experts again, at 2 and 6 cold a layer."""
    for label, fresh in (("same experts", False), ("different experts", True), ("same experts again", False)):
        for cold in (2, 6):
            fixed = [rng.choice(p, k, replace=False) for p in pinned]
            slots = torch.tensor([-1] * cold + [0] * (k - cold), dtype=torch.int32, device=dev)
            c0 = box.counters.copy()
            for _ in range(replays):
                box.begin_step()
                for i, layer in enumerate(box.layers):
                    ids = rng.choice(pinned[i], k, replace=False) if fresh else fixed[i]
                    box.exchange(layer, torch.from_numpy(ids).to(dev), slots, x, w)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            d = box.counters - c0
            rows.append({"case": label, "cold_experts": cold, "kernel_GB_s": round(d[1] / d[2], 1) if d[2] else None,
                         "kernel_us_per_layer": round(d[2] / max(1, d[3]) / 1e3, 1),
                         "serve_us_per_layer": round(d[7] / max(1, d[3]) / 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()

"""Can the GPU compute a cold expert straight from pinned host RAM (zero-copy), with no staging copy?

    python bench/probes/zero_copy.py [--out DIR]

The pair kernels (`strata.kernels.gpu.experts.grouped.pair_experts`) run one decode token's experts (Qwen3-30B-A3B
shape, 9.4 MB each) with their weights in: HBM (the resident case); pinned RAM from `cudaHostAlloc`
read in place through a device view (`strata.tiers.storage.uva.device_view`); the pinned pool's registered slabs
read the same way. Reports GB/s of expert weights read per call for 1, 2, 4 and 8 experts, per block
configuration, alone and while the CPU reads RAM on 15 threads (the CPU share of a split step), against
the copy engine's pinned -> GPU rate measured in the same run. Writes zero_copy.json.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

H, INTER, E = 2048, 768, 8  # hidden, expert intermediate, experts per set
EXPERT_BYTES = 3 * H * INTER * 2


def expert_set(where: str, pool=None, first: int = 0):
    """gate_up [E, 2I, H], down [E, H, INTER] bf16 in HBM or in pinned RAM viewed from the GPU."""
    from strata.kernels.gpu.experts.grouped import SlotWeights
    from strata.tiers.storage.uva import device_view

    numel = E * 3 * H * INTER
    if where == "hbm":
        flat = torch.randn(numel, device="cuda", dtype=torch.bfloat16) / 32
    elif where == "host_alloc":
        host = (torch.randn(numel) / 32).to(torch.bfloat16).pin_memory()
        flat = device_view(host, torch.device("cuda"))
    else:  # registered pool slab: E consecutive slots of one slab
        slots = [pool.slot(first + j) for j in range(E)]
        base = slots[0]
        span = slots[-1].data_ptr() + slots[-1].numel() - base.data_ptr()
        whole = torch.as_strided(base, (span,), (1,))  # the slab bytes from the first slot to the last
        flat = device_view(whole, torch.device("cuda"))
        if flat is None:
            return None
        flat = flat.view(torch.bfloat16)[: numel]
    if flat is None:
        return None
    gu = flat[: E * 2 * INTER * H].view(E, 2 * INTER, H)
    dn = flat[E * 2 * INTER * H :].view(E, H, INTER)
    return SlotWeights(gu, dn)


def time_pairs(sw, n_experts: int, reps: int = 20) -> float:
    """Seconds per pair_experts call with one token routed to `n_experts` distinct experts."""
    from strata.kernels.gpu.experts.grouped import pair_experts

    ident = torch.arange(E, dtype=torch.int32, device="cuda")
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(n_experts, device="cuda")
    y = torch.zeros(n_experts, H, device="cuda")
    graph = torch.cuda.CUDAGraph()  # replayed: kernel time, not Python launch time
    pair_experts(x, sw, ident, ids, y)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        pair_experts(x, sw, ident, ids, y)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def copy_rate(pool, n: int = 32) -> float:
    dst = torch.empty((n, EXPERT_BYTES), dtype=torch.uint8, device="cuda")
    src = [pool.slot(i) for i in range(n)]
    for i in range(n):
        dst[i].copy_(src[i], non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        dst[i].copy_(src[i], non_blocking=True)
    torch.cuda.synchronize()
    return n * EXPERT_BYTES / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    from strata.kernels.cpu import experts as ce
    from strata.kernels.gpu.experts import grouped
    from strata.tiers.storage.pinned import PinnedPool

    pool = PinnedPool(EXPERT_BYTES, 48, background=False)
    for i in range(48):
        pool.slot(i).view(torch.bfloat16).copy_((torch.randn(EXPERT_BYTES // 2) / 32).to(torch.bfloat16))
    out: dict = {"expert_bytes": EXPERT_BYTES, "copy_engine_GB_s": round(copy_rate(pool), 1), "cases": []}
    sets = {w: expert_set(w, pool) for w in ("hbm", "host_alloc", "registered")}
    out["views"] = {w: s is not None for w, s in sets.items()}
    cpu_bufs = [torch.ones(EXPERT_BYTES, dtype=torch.uint8) for _ in range(64)]
    stop = threading.Event()

    def cpu_load():
        while not stop.is_set():
            ce.read_sweep(cpu_bufs, 15)

    for blocks in [(8, 512, 16, 256), (4, 256, 8, 128), (16, 256, 32, 128), (2, 1024, 8, 512)]:
        grouped.BLOCKS = {"small": blocks, "large": blocks}
        for where, sw in sets.items():
            if sw is None:
                continue
            for n in (1, 2, 4, 8):
                s = time_pairs(sw, n)
                out["cases"].append({"blocks": blocks, "where": where, "experts": n, "us": round(s * 1e6, 1),
                                     "GB_s": round(n * EXPERT_BYTES / s / 1e9, 1)})
    # with the CPU reading RAM meanwhile (the CPU share of a split step)
    grouped.BLOCKS = {"small": (8, 512, 16, 256), "large": (8, 512, 16, 256)}
    loader = threading.Thread(target=cpu_load, daemon=True)
    loader.start()
    time.sleep(0.2)
    for where in ("host_alloc", "registered"):
        if sets[where] is not None:
            for n in (2, 4):
                s = time_pairs(sets[where], n, reps=40)
                out["cases"].append({"blocks": "default", "where": where + "+cpu_load", "experts": n,
                                     "us": round(s * 1e6, 1), "GB_s": round(n * EXPERT_BYTES / s / 1e9, 1)})
    stop.set()
    loader.join()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "zero_copy.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "cases"}))
    for c in out["cases"]:
        print(json.dumps(c))


if __name__ == "__main__":
    main()

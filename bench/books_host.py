"""Host time of one-graph split decode's bookkeeping per step (`MailboxBooks.flush`), on any machine.

    python bench/books_host.py [--layers 12] [--experts 128] [--top-k 8] [--gpu-fraction 0.25] [--skew 1.0]
                               [--steps 200] [--profile] [--out DIR]

On the H200 box the books took 1.1-1.8 ms of Python a decode step (bench/step_timeline.py), as long as a third of
a skewed step (then on a thread of their own competing with the decoding thread for the GIL; now on the decoding
thread while the GPU runs the step). This drives the same objects on a
synthetic store of the bench model's expert count and tiny experts: the real tier manager (a GPU tier of
`--gpu-fraction` of the experts on the CPU device, everything pinned), the real native worker and its log, and the
real books (promotions decided as in decode, not copied unless --copy-promotions). Each step routes one token's top-k per layer
(Zipf popularity `--skew`, 0: uniform), lets the worker serve it, then times `flush`. Writes books_host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--gpu-fraction", type=float, default=0.25)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--copy-promotions", action="store_true",
                    help="let promotions copy (transfer workers then compete for the GIL with the timed books)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from bench.promote_sim import key_store
    from strata.kernels import cpu_experts as ce
    from strata.runtime.cpu_mailbox import CpuMailbox
    from strata.runtime.expert_compute import ExpertCompute
    from strata.runtime.mailbox_books import MailboxBooks
    from strata.tiers.manager import TierBudgets, TierManager
    from strata.tiers.store import ExpertStore

    if ce.backend() == "torch":
        raise SystemExit("books_host: needs the compiled CPU expert kernel (the mailbox worker)")
    root = Path(tempfile.mkdtemp(prefix="strata-books-"))
    store = ExpertStore.open(key_store(root, args.layers, args.experts, args.top_k))
    hidden = store.expert_shapes[0][1]
    n = args.layers * args.experts
    gpu_slots = int(n * args.gpu_fraction)
    m = TierManager(store, TierBudgets(gpu_slots=gpu_slots, pinned_slots=n), gpu_device=torch.device("cpu"), io_threads=2)
    compute = ExpertCompute(m, "gpu", "fork")
    if not args.copy_promotions:  # decided and counted, as in decode, but not copied: the books' own time alone
        m.promote = lambda key: None
    rng = np.random.default_rng(0)
    pop = (1.0 / np.arange(1, args.experts + 1) ** args.skew) if args.skew > 0 else np.ones(args.experts)
    perm = [rng.permutation(args.experts) for _ in range(args.layers)]  # each layer's popularity order
    prob = pop / pop.sum()
    # placement: everything pinned, the GPU tier holds each layer's most popular experts (as placement would)
    m.place([(li, e) for li in range(args.layers) for e in range(args.experts)], "cpu")
    m.place([(li, int(perm[li][j])) for j in range(gpu_slots // args.layers) for li in range(args.layers)], "gpu")
    while not m.all_pinned() or len(m.gpu.slot_of) < gpu_slots // args.layers * args.layers or m.gpu.inflight:
        time.sleep(0.05)
    addresses = np.zeros((args.layers, args.experts), dtype=np.int64)
    for (layer, e), slot in m.pinned.slot_of.items():
        addresses[layer, e] = m.pool.slot_address(slot)
    box = CpuMailbox(list(range(args.layers)), addresses, hidden=hidden, inter=store.expert_shapes[1][1], gu_bytes=store.index.gate_up_bytes,
                     payload=store.payload_bytes, top_k=args.top_k, max_tokens=1, threads=2, device=torch.device("cpu"))
    compute._mailbox_kernel = (0, 0, 0.0)  # as ExpertCompute._open_mailbox sets it
    books = MailboxBooks(box, m, compute.promote_one, compute._count_mailbox)  # flushed here, on this thread, and timed
    times, prof = [], cProfile.Profile() if args.profile else None
    try:
        for _ in range(args.steps):
            box.begin_step()
            for li in range(args.layers):
                ids = perm[li][rng.choice(args.experts, args.top_k, replace=False, p=prob)]
                slots = [m.gpu.slot_of.get((li, int(e)), -1) for e in ids]
                box.exchange(li, torch.from_numpy(ids.astype(np.int64)), torch.tensor(slots, dtype=torch.int32),
                             torch.randn(1, hidden), torch.rand(1, args.top_k))
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            books.flush()
            if prof is not None:
                prof.disable()
            times.append(time.perf_counter() - t0)
        res = {"layers": args.layers, "experts": args.experts, "top_k": args.top_k, "skew": args.skew,
               "steps": args.steps, "flush_us_median": round(1e6 * float(np.median(times)), 1),
               "flush_us_mean": round(1e6 * float(np.mean(times)), 1), "promotions": compute.promotions,
               "gpu_hit_rate": round(m.stats()["hit_rate"].get("gpu", 0.0), 3)}
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            res["profile"] = s.getvalue()
        print(json.dumps({k: v for k, v in res.items() if k != "profile"}))
        if prof is not None:
            print(res["profile"])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "books_host.json").write_text(json.dumps(res, indent=2))
    finally:
        box.close()
        m.close()
        store.close()


if __name__ == "__main__":
    main()

"""Do transparent huge pages behind the pinned pool speed up reading experts from it?

    python bench/hugepage_probe.py [--experts 48] [--threads 12] [--rounds 2] [--out DIR]

The pinned pool's slabs are anonymous mmaps registered with CUDA; in THP's madvise mode they get 4 KiB pages unless
asked (`PinnedPool(huge_pages=True)`, $STRATA_PINNED_HUGE_PAGES=1). Reading a 9.4 MB expert then walks ~2,300
pages: on the CPU (the mailbox worker's kernel) and on the GPU (its in-place reads over PCIe translate each page).
For a pool of each kind, alternated `--rounds` times, this prints: the THP settings, the pool's AnonHugePages, the
copy engine's pinned -> GPU rate, the GPU's in-place read rate (the pair kernels on 1, 2 and 4 experts, as
bench/zero_copy.py), and the CPU kernel's rate on a split layer's shares (as bench/cpu_kernel_trace.py, 12
threads). Writes hugepage_probe.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_kernel_trace as trace  # noqa: E402
import zero_copy as zc  # noqa: E402

from strata.tiers.pinned import PinnedPool, huge_page_kib  # noqa: E402


def measure(huge: bool, experts: int, threads: int) -> dict:
    pool = PinnedPool(zc.EXPERT_BYTES, experts, background=False, huge_pages=huge)
    gen = torch.Generator().manual_seed(0)
    for i in range(experts):
        pool.slot(i).view(torch.bfloat16).copy_((torch.randn(zc.EXPERT_BYTES // 2, generator=gen) / 32).to(torch.bfloat16))
    rec: dict = {"huge_pages": huge, "anon_huge_MiB": (huge_page_kib(pool.slot(0).data_ptr()) or 0) // 1024,
                 "copy_engine_GB_s": round(zc.copy_rate(pool), 1)}
    sw = zc.expert_set("registered", pool)
    rec["in_place_GB_s"] = {n: round(n * zc.EXPERT_BYTES / zc.time_pairs(sw, n, reps=40) / 1e9, 1) for n in (1, 2, 4)}
    elems = zc.EXPERT_BYTES // 2
    slab = torch.as_strided(pool.slot(0).view(torch.bfloat16), (experts, elems), (elems, 1))  # one slab's experts
    rng = np.random.default_rng(0)
    trace.run_share(slab, 1, 1.0, False, 20, threads, 80, rng)  # the kernel's threads up
    rec["cpu_GB_s"] = {}
    for n, frac in ((1, 0.6), (2, 1.0), (4, 1.0)):
        r = trace.run_share(slab, n, frac, False, 200, threads, 80, rng)
        rec["cpu_GB_s"][f"{n}x{frac}"] = round(r["gbps"], 1)
    pool.close()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    thp = {}
    for name in ("enabled", "defrag"):
        try:
            thp[name] = open(f"/sys/kernel/mm/transparent_hugepage/{name}").read().strip()
        except OSError:
            thp[name] = None
    print(json.dumps({"thp": thp}))
    runs = []
    for _ in range(args.rounds):
        for huge in (False, True):
            runs.append(measure(huge, args.experts, args.threads))
            print(json.dumps(runs[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hugepage_probe.json").write_text(json.dumps({"thp": thp, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

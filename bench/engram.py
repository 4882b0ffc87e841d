"""Engram benchmark: decode tokens/s with the Engram tables in VRAM, pinned RAM and tmpfs (each read in
place, and through the row cache), and disk (and disk with prefetch off), tables >= 10x the GPU row cache,
Zipf-distributed n-gram traffic.

    python bench/engram.py --out results/engram [--table-rows 4000000] [--row-cache 256MiB] [--batch 8] [--steps 256]

Model: the `small` demo model with its Engram tables enlarged (2 layers; rows of 32 bf16 = 64 B;
8 heads per layer of about `--table-rows` rows each). Traffic: `--batch` sequences decode `--steps`
tokens each, one token per sequence per forward pass, the tokens drawn from a Zipf distribution
(exponent `--zipf`) over the vocabulary (teacher-forced, so every tier sees the same rows); or, with
`--text FILES`, real text's tokens, the first `--prime` of each stream's rows put in the row caches first.
All seven engines are open at once in one process; after a warm-up each, the timed steps run in
`--rounds` interleaved rounds (a shuffled order each round; every block starts after 2 untimed steps),
and each case reports tok/s at its median step time (every timed step is synchronised; the mean and the
p10/p90 step times are kept too), so drift and the occasional stall (clocks, background threads, Python's
collector) fall on every case alike rather than on whichever ran first.
Writes engram.json under --out: per case tok/s, slowdown vs VRAM and the row store's statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from strata import Engine
from strata.runtime.demo import engram as engram_demo
from strata.runtime.demo.model import write_demo_model
from strata.runtime.model.kv_cache import KVCache, StepBatch
from strata.tiers.storage.diskio import fs_type

# (tier, prefetch, zero_copy): [debug] engram_prefetch and engram_zero_copy; zero_copy matters for pinned and tmpfs
# tables (read in place vs the row cache)
CASES = [("gpu", True, True), ("pinned", True, True), ("pinned", True, False), ("tmpfs", True, True),
         ("tmpfs", True, False), ("disk", True, True), ("disk", False, True), ("disk", True, True, False),
         ("disk", True, True, True, False)]
# a fourth field False: the disk reader's runs read from Python, not natively (strata.tiers.storage.native_io);
# a fifth False: debug.engram_graph_wait off (the graph cut at each Engram layer, rows served between the pieces)


def case_name(tier: str, prefetch: bool, zero_copy: bool, native: bool = True, graph_wait: bool = True) -> str:
    """A case's name in the report: the tier, "-noprefetch", "-cached" (the row cache instead of in place),
    "-pyio" (disk reads issued from Python), "-segmented" (no device-side wait for the rows)."""
    return (tier + ("" if prefetch else "-noprefetch") + ("-cached" if not zero_copy else "") + ("" if native else "-pyio")
            + ("" if graph_wait else "-segmented"))


def zipf_tokens(n: int, vocab: int, a: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(a, n), vocab) - 1
    return rng.permutation(vocab)[ranks]  # rank -> a fixed random token id


def text_streams(files: list[str], model_dir: Path, batch: int, length: int) -> torch.Tensor:
    """`batch` token streams of `length` tokens from real text (`files` concatenated, tokenized with the model's
    own tokenizer; stream i is the i-th slice), int64 [batch, length]. Raises when the text is too short."""
    from strata.runtime.generation.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("\n".join(Path(f).read_text(errors="ignore") for f in files))
    if len(ids) < batch * length:
        raise SystemExit(f"--text: {len(ids)} tokens, {batch * length} needed (--prime, --warmup, --steps)")
    return torch.tensor(ids[: batch * length], dtype=torch.int64).view(batch, length)


def prime(rt, history: torch.Tensor) -> None:
    """Fill the row cache of Engram runtime `rt` with the rows of `history` ([batch, n] tokens before each stream): a
    server that has already decoded that much text. Only row caches in front of a table tier are primed."""
    if getattr(rt.source, "cache", None) is None:
        return
    for row in history:
        rt.prefetch(row)
    rt.source.absorb_prefetches()


class Case:
    """One engine (one table tier) with its own KV cache, stepped through the shared token stream."""

    def __init__(self, model_dir: Path, tier: str, prefetch: bool, zero_copy: bool, native: bool, graph_wait: bool,
                 args, stream: torch.Tensor, stack):
        conf = {"engram": {"tier": tier, "row_cache": args.row_cache},
                "debug": {"engram_prefetch": prefetch, "engram_zero_copy": zero_copy, "engram_graph_wait": graph_wait},
                "tiers": {"disk": {"scrub": False, "path": args.store_dir}, "tmpfs": {"budget": "64GiB"}},
                "prefetch": {"lookahead": 1}}
        t_load = time.perf_counter()
        self.eng = stack.enter_context(Engine.from_pretrained(model_dir, config=conf, device="cuda"))
        self.load_s = time.perf_counter() - t_load
        self.eng.wait_settled()  # the experts' start-up placement must not run inside the timed steps
        self.tier, self.prefetch, self.zero_copy, self.stream, self.t = tier, prefetch, zero_copy, stream, 0
        self.name = case_name(tier, prefetch, zero_copy, native, graph_wait)
        reader = getattr(self.eng.model.engram.source, "reader", None)
        if reader is not None and not native:
            reader.native = False
        self.cache = KVCache(self.eng.checkpoint.config, stream.shape[0], stream.shape[1] + 8, self.eng.dtype, self.eng.device)
        self.seconds: list[float] = []  # one entry per timed round
        self.step_s: list[float] = []  # every timed step
        self.base = self.eng.model.engram.stats()

    def steps(self, n: int, untimed: int = 0) -> float:
        """Decode `untimed` then `n` teacher-forced tokens per sequence; seconds the `n` took (synchronised)."""
        model, dev = self.eng.model, self.eng.device
        b = self.stream.shape[0]
        t0 = None
        with torch.inference_mode():
            for i in range(untimed + n):
                if i == untimed:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                t_step = time.perf_counter()
                ids = self.stream[:, self.t].to(dev)
                model(ids, StepBatch(list(range(b)), [self.t] * b, [1] * b), self.cache)
                model.logits(torch.zeros(b, model.cfg.hidden_size, device=dev, dtype=self.eng.dtype))
                self.t += 1
                if i >= untimed:  # eager Engram steps sync on the host anyway (token ids to the hasher)
                    torch.cuda.synchronize()
                    self.step_s.append(time.perf_counter() - t_step)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def report(self, tokens_per_round: int) -> dict:
        after = self.eng.model.engram.stats()
        delta = {k: after[k] - self.base[k] for k in ("lookups", "unique_rows", "bytes_read", "stall_s")}
        delta["hits"] = {k: v - self.base["hits"].get(k, 0) for k, v in after["hits"].items()}
        rates = [tokens_per_round / s for s in self.seconds]
        b, q = self.stream.shape[0], statistics.quantiles(self.step_s, n=10)
        name = self.name
        g = self.eng.model.graphs  # whether this tier's decode steps replayed CUDA graphs or ran eagerly
        graphs = None if g is None else {"replays": g.replays, "captures": g.captures, "failed": dict(g.failed),
                                         "mode": g.mode(),  # "full": one graph a step, "segmented": host steps between
                                         "segmented": any(type(x.graph).__name__ == "SegmentRecorder"
                                                          for x in g.graphs.values())}
        m, compute = self.eng.tiers, self.eng.executor
        experts = None if m is None else {  # why decode steps are (not) one graph: every expert in a GPU slot?
            "keys": len(m.store.keys()), "gpu_capacity": m.gpu.capacity if m.gpu is not None else 0,
            "gpu_resident": len(m.gpu.slot_of) if m.gpu is not None else 0,
            "gpu_inflight": len(m.gpu.inflight) if m.gpu is not None else 0, "stream_slots": len(m.stream_slots),
            "pinned_capacity": m.pinned.capacity, "all_resident": compute.all_resident(),
            "plan_gpu_slots": self.eng.plan.budgets() if self.eng.plan is not None else None}
        return {"name": name, "experts": experts, "tier": self.tier, "prefetch": self.prefetch, "zero_copy": self.zero_copy, "tok_per_s": b / statistics.median(self.step_s),
                "mean_tok_per_s": b * len(self.step_s) / sum(self.step_s),
                "step_ms": {"p10": round(q[0] * 1e3, 3), "median": round(statistics.median(self.step_s) * 1e3, 3),
                            "p90": round(q[-1] * 1e3, 3)},
                "rounds_tok_per_s": [round(r, 1) for r in rates], "load_s": self.load_s, "graphs": graphs,
                "measured": delta, "totals": after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", default=None, help="where to write the enlarged demo model (default: under --out)")
    p.add_argument("--store-dir", default="~/.cache/strata-engram-bench",
                   help="tiers.disk.path: where the store (the disk tier) is built; must be a real disk, not tmpfs")
    p.add_argument("--table-rows", type=int, default=4_000_000, help="base rows per hash head (8 heads per layer)")
    p.add_argument("--row-cache", default="256MiB")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds (steps are split among them)")
    p.add_argument("--text", default=None, help="comma-separated text files: decode their tokens (the model's tokenizer, "
                   "--batch consecutive slices) instead of i.i.d. Zipf tokens")
    p.add_argument("--prime", type=int, default=0, help="with --text: tokens per stream whose rows fill the row caches "
                   "before the warm-up (a server that has already decoded that much)")
    p.add_argument("--cases", default=None,
                   help="comma-separated case names to run (default: all; the first must be gpu, the baseline)")
    p.add_argument("--profile", default=None, help="a case name whose timed rounds run under cProfile "
                   "(writes profile-NAME.txt: host time per function, cumulative)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir or out / f"demo-small-engram-{args.table_rows}")
    store_dir = Path(args.store_dir).expanduser()
    store_dir.mkdir(parents=True, exist_ok=True)
    store_fs = fs_type(str(store_dir))
    if store_fs in ("tmpfs", "ramfs"):
        print(f"warning: --store-dir {store_dir} is on {store_fs}: the disk cases will read RAM, not a disk", flush=True)
    with engram_demo.demo_tables("small", args.table_rows):  # tables far larger than the row cache
        write_demo_model(model_dir, "small", progress=True)
    per_round = args.steps // args.rounds
    length = args.warmup + args.steps + 2 * args.rounds
    if args.text:  # real text: the first --prime tokens of each stream prime the row caches, the rest is decoded
        both = text_streams(args.text.split(","), model_dir, args.batch, args.prime + length)
        history, stream = both[:, : args.prime], both[:, args.prime :].contiguous()
    else:
        tokens = zipf_tokens(args.batch * length, 8192, args.zipf, seed=0)
        history, stream = None, torch.from_numpy(tokens).view(args.batch, -1)  # [batch, warmup + rounds * (2 + per_round)]
    with contextlib.ExitStack() as stack:
        wanted = args.cases.split(",") if args.cases else None
        cases = [Case(model_dir, *(case + (True, True))[:5], args, stream, stack) for case in CASES
                 if wanted is None or case_name(*case) in wanted]
        if not cases or cases[0].tier != "gpu":
            raise SystemExit("--cases must include gpu (the baseline every other case is compared with)")
        prof = cProfile.Profile() if args.profile else None
        for c in cases:  # warm-up (fills the row caches, compiles the step shapes), then every engine idles
            if history is not None and args.prime:
                prime(c.eng.model.engram, history)
            c.steps(args.warmup)
            c.base = c.eng.model.engram.stats()
        order = random.Random(0)
        for _ in range(args.rounds):  # interleaved rounds in shuffled orders: drift hits every case alike
            for c in order.sample(cases, len(cases)):  # 2 untimed steps first: switching engines costs nothing timed
                profiled = prof is not None and c.name == args.profile
                if profiled:
                    prof.enable()
                c.seconds.append(c.steps(per_round, untimed=2))
                if profiled:
                    prof.disable()
        results = [c.report(args.batch * per_round) for c in cases]
    for r in results:
        print(f"{r['name']:15s} {r['tok_per_s']:8.1f} tok/s at the median step "
              f"(mean {r['mean_tok_per_s']:.1f}; step ms {r['step_ms']}; rounds {r['rounds_tok_per_s']})  "
              f"stall {r['measured']['stall_s']:.3f}s hits {r['measured']['hits']} graphs {r['graphs']}", flush=True)
    vram = results[0]["tok_per_s"]
    for r in results:
        r["slowdown_vs_vram"] = 1.0 - r["tok_per_s"] / vram
        r["slowdown_vs_vram_mean"] = 1.0 - r["mean_tok_per_s"] / results[0]["mean_tok_per_s"]
    table_bytes = results[0]["totals"]["table_bytes"]
    report = {"store_dir": str(store_dir), "store_fs": store_fs, "table_bytes": table_bytes,
              "row_cache": args.row_cache, "batch": args.batch, "steps": args.steps,
              "zipf": None if args.text else args.zipf, "text": args.text, "prime": args.prime,
              "device": torch.cuda.get_device_name(), "cases": results,
              "targets": {"pinned": 0.03, "tmpfs": 0.05, "disk": 0.15}}
    (out / "engram.json").write_text(json.dumps(report, indent=2))
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        (out / f"profile-{args.profile}.txt").write_text(text.getvalue())
    print(json.dumps({r["name"]: round(r["slowdown_vs_vram"], 4)
                      for r in results}))


if __name__ == "__main__":
    main()

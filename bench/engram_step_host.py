"""Host time of a whole disk-tier Engram decode step, through the engine's own objects, on any machine.

    python bench/engram_step_host.py [--table-rows 400000] [--batch 8] [--steps 300] [--row-cache 64MiB] [--profile]

What the host does for one step of a segmented decode graph with Engram tables on disk (bench/engram.py's
"disk" case on the GPU box), without the GPU: `EngramRuntime.begin` (the n-grams from the token history,
hashing, cache lookups, the reads issued), `StaticEngramStep.bind` (tap and ring indices, the row-cache
check) and, per Engram layer, `publish` (that layer's reads awaited, its rows admitted to the host row
cache, their slots uploaded) — each phase timed, plus the part of `publish` spent waiting for reads. The
gathers themselves (GPU work inside the graph on the box) are left out. The model is bench/engram.py's
(the `small` demo model with 2 Engram layers), its tables enlarged to `--table-rows` rows per head, built
under `--work` on a real disk; `--batch` sequences decode Zipf(1.1) tokens, teacher-forced.
Writes engram_step_host.json (with `--profile`, the host functions by own time too).

`--handshake`: the step as a one-graph decode step with `engram.graph_wait` serves it instead (the "device"
side on this CPU: the row ids posted, each layer's answer awaited natively): the handshake thread's own
timing (lookups and reads queued, the first layer answered, the whole step) and the step's wall time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch

from strata import Engine
from strata.runtime import engram_demo
from strata.runtime.demo_model import write_demo_model
from strata.runtime.engram_decode import StaticEngramStep
from strata.runtime.kv_cache import KVCache, StepBatch

PHASES = ("begin", "bind", "publish", "waiting")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-rows", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--row-cache", default="64MiB")
    ap.add_argument("--work", default="~/.cache/strata-engram-step", help="a real disk (not tmpfs)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=".")
    ap.add_argument("--handshake", action="store_true", help="serve steps through the rows' handshake")
    ap.add_argument("--text", default=None, help="comma-separated text files: their tokens instead of Zipf(1.1) ones")
    ap.add_argument("--prime", type=int, default=0, help="with --text: tokens per stream put in the row cache first")
    args = ap.parse_args()
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    with engram_demo.demo_tables("small", args.table_rows):
        model_dir = write_demo_model(work / f"small-engram-{args.table_rows}", "small", progress=True)
    conf = {"engram": {"tier": "disk", "row_cache": args.row_cache}, "tiers": {"disk": {"path": str(work), "scrub": False}}}
    rng = np.random.default_rng(0)
    n = args.warmup + args.steps * (2 if args.profile else 1)
    tokens = torch.from_numpy(rng.permutation(8192)[np.minimum(rng.zipf(1.1, (n, args.batch)), 8192) - 1])
    history = None
    if args.text:  # real text (bench/engram.py's streams): [n, batch] after each stream's --prime tokens
        from engram import prime, text_streams

        both = text_streams(args.text.split(","), model_dir, args.batch, args.prime + n)
        history, tokens = both[:, : args.prime], both[:, args.prime :].T.contiguous()
    with Engine.from_pretrained(model_dir, device="cpu", config=conf) as eng:
        rt, layers = eng.model.engram, eng.model.layers
        if history is not None and args.prime:
            prime(rt, history)
        if args.handshake:
            result = handshake_steps(eng, tokens, args)
            print(json.dumps(result))
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "engram_step_host.json").write_text(json.dumps(result, indent=1))
            return
        cache = KVCache(eng.checkpoint.config, args.batch, n + 8, eng.dtype, "cpu")
        seconds = dict.fromkeys(PHASES, 0.0)
        statics = None
        store = rt.source
        with torch.inference_mode():
            for t in range(n):
                if t == args.warmup:
                    seconds = dict.fromkeys(PHASES, 0.0)
                    stall0 = store.stats_.stall_s
                if args.profile and t == args.warmup + args.steps:
                    prof = cProfile.Profile()
                    prof.enable()
                t0 = time.perf_counter()
                step = rt.begin(tokens[t], StepBatch(list(range(args.batch)), [t] * args.batch, [1] * args.batch),
                                cache, layers)
                t1 = time.perf_counter()
                if statics is None:  # the capture: built from the first step
                    statics = StaticEngramStep(step)
                    statics._per_layer = True  # as a segmented capture sets it
                    continue
                statics.bind(step)
                t2 = time.perf_counter()
                for layer in rt.cfg.layer_ids:
                    statics.publish(layer)
                t3 = time.perf_counter()
                statics.replayed()
                if t < args.warmup + args.steps:
                    for k, v in (("begin", t1 - t0), ("bind", t2 - t1), ("publish", t3 - t2)):
                        seconds[k] += v
        seconds["waiting"] = store.stats_.stall_s - stall0
        us = {k: round(v / args.steps * 1e6, 1) for k, v in seconds.items()}
        result = {"args": vars(args), "us_per_step": us, "total_us": round(sum(us[k] for k in PHASES[:3]), 1),
                  "rows": store.stats()}
        if args.profile:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
            result["profile"] = buf.getvalue()
    print(f"host us per step: {us} (total {result['total_us']})")
    if args.profile:
        print(result["profile"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engram_step_host.json").write_text(json.dumps(result, indent=1))


def handshake_steps(eng, tokens: torch.Tensor, args) -> dict:
    """Steps served by the rows' handshake on this CPU (strata.tiers.engram_handshake): per-step wall time and
    the handshake thread's phases, in microseconds per step, after the warm-up."""
    from strata.runtime.kv_cache import DecodeBatch
    from strata.tiers.engram_handshake import RowHandshake

    rt, layers, store = eng.model.engram, eng.model.layers, eng.model.engram.source
    store.handshake = rt.handshake = RowHandshake(store, rt.cfg.layer_ids, rt.cfg.num_heads, args.batch,
                                                  torch.device("cpu"))
    b = args.batch
    cache = KVCache(eng.checkpoint.config, b, tokens.shape[0] + 8, eng.dtype, "cpu")
    slots = torch.arange(b)
    wall = 0.0
    with torch.inference_mode():
        for t in range(args.warmup + args.steps):
            if t == args.warmup:
                base, stall0, wall = dict(rt.handshake.stats()), store.stats_.stall_s, 0.0
            t0 = time.perf_counter()
            rt.device_step_queued(layers, b)
            step = rt.begin(tokens[t], DecodeBatch(slots, torch.full((b,), t), tokens.shape[0] + 8), cache, layers)
            for layer in rt.cfg.layer_ids:
                step.rows(layer)
            wall += time.perf_counter() - t0
    after = rt.handshake.stats()
    per = {k: round((after[k] - base[k]) / args.steps * 1e6, 1) for k in ("serve_s", "first_layer_s")}
    per["waiting_reads"] = round((store.stats_.stall_s - stall0) / args.steps * 1e6, 1)
    per["step_wall"] = round(wall / args.steps * 1e6, 1)
    return {"args": vars(args), "us_per_step": per, "rows": store.stats()}


if __name__ == "__main__":
    main()

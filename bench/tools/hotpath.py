"""Decode and prefill on tiers: the `bench` demo model (Qwen3-30B-A3B shape) with part of its experts in VRAM.

    python bench/tools/hotpath.py --model DIR [--gpu-fraction 0.25] [--tokens 64] [--prefill 8192] [--out DIR]

Cases, all in this one run on the same weights (the store is built once, on first use):
  ceiling        every expert in VRAM (runtime.experts = "memory"), decode steps replayed as CUDA graphs
  ceiling_eager  the same without graphs (debug.cuda_graphs = false: what the graphs are worth)
  ceiling_unfused, split_unfused   the same with the fused decode kernels off (debug.fused_kernels = false:
                 torch's op chains; what strata.kernels.gpu.fused and decode_attention are worth)
  ceiling_nofolds, split_nofolds   the same with the folds off (the module flag fused.FOLDS: cache writes in the
                 key's rotary kernel, residual add in the next norm, q/k/v in one GEMM; what they are worth)
  split          GPU budget = fraction of the expert bytes, the rest in pinned RAM; cold experts split
                 between the CPU kernel and PCIe copies by the cost model (cpu_numerics = "fork")
  split_nopromote split without promotions (policy.promote = false: the GPU tier keeps its initial placement)
  split_t14      split with 14 CPU kernel threads (debug.cpu_threads = 14): two cores left to the host step
  copy           the same budget, cold experts always copied (cpu_numerics = "gpu": bit-exact mode)
  cpu            GPU budget 0: every routed expert computed on the CPU from RAM
Modifiers, appended with "+" to any case (e.g. `split+noprefetch+spin2000`), for A/B runs in one call:
  noprefetch     prefetch.lookahead = 0
  shareX         one-graph split decode: a fixed GPU share X of the cold experts read in place (debug.gpu_share = X;
                 0: none; default: adapted from the GPU's wait for the CPU worker)
  norouter       decode routing in three launches (cuBLAS GEMV, softmax top-k, slot gather) instead of the one of
                 strata.kernels.gpu.decode_router (its module flag ENABLED off)
  noresidual     a MoE layer's residual added by its own launch instead of in the experts' combine
                 (the module flag fused.RESIDUAL_FOLD off)
  nogemv         decode's attention projections through cuBLAS instead of strata.kernels.gpu.decode_gemv (its module
                 flag ENABLED off)
  noqk           a decode layer's query norm and rotary in their own launch instead of in the keys' cache write
                 (the module flag fused.QK_FOLD off)
  nopdl          decode's Triton kernels launched without programmatic dependent launch (debug.pdl = false;
                 strata.kernels.gpu.pdl)
  nowarm         one-graph split decode without warm-ahead (debug.warm_ahead = false; on by default: the worker
                 reads the next layer's predicted cold experts' gate/up rows into its threads' caches during the
                 serial phase, strata.runtime.offload.warm_ahead)
  grouped        debug.grouped_prefill = true: prefill's experts through two grouped GEMMs a layer
  sync           debug.overlap_decode = false: each token read on the host before the next step is queued
  host           debug.split_decode = "host": host steps at every MoE layer (the cost model splits the cold
                 experts between the CPU and copies) instead of one graph a step with the mailbox worker
  tN             N CPU kernel threads (debug.cpu_threads = N)
  spinN          the CPU kernel's idle workers spin N us before sleeping (cpu_experts.configure(spin_us=N))
  claimN         the CPU kernel's threads claim up to N down chunks and read them while the gate/up phase finishes
                 (cpu_experts.tune(claim_ahead=N); default 4, 0 off)
  dsplit, dsplit0  the CPU kernel reads its down rows as two streams a thread, or adjacent rows as one
                 (cpu_experts.tune(down_split=1 or 0); default 1)
  chunkdivN      the CPU kernel's chunks of total / (N x threads) bytes (cpu_experts.tune(chunk_div=N); default 8)
  wsN, wtN       warm-ahead's read takes N rows at a time, line-interleaved / touches one line in N
                 (cpu_experts.tune(warm_streams=N) / tune(warm_touch=N); default 4 and 1)
  rest0          the kernel's dynamic chunks sized from the whole call, not from the rows not read ahead
                 (cpu_experts.tune(rest_chunks=0); default 1)
  rs0            a warm piece's rows that its thread's read did not reach computed by that thread, not shared out
                 (cpu_experts.tune(read_split=0); default 1)
  swN            the interpreter's GIL switch interval set to N us (sys.setswitchinterval; default 5000)
  again          nothing: the same case run a second time (a run-order check)
Decode samples at temperature 1 (fixed seed) so a random-weight model does not repeat itself and
routing stays close to uniform (the worst case). Each case reports decode tok/s over the decode phase
(one stream, 128-token prompt; the prompt's prefill is timed apart as `ttft_s`), GPU hit rate, bytes over PCIe per token, CPU-computed experts per token, stall per token, and
the roofline: time per token >= max(GPU time, cold bytes / (PCIe + CPU rates)) with GPU time the
ceiling's measured step and the H200 machine's reference rates (55 GB/s PCIe + 70 GB/s CPU; only the paths a case
may use). `--prefill N` also times an N-token prompt (time to first token) in the ceiling and split
cases. Writes hotpath.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.*` when run as a script
from bench.decode_timing import timed_decode  # noqa: E402

PCIE, CPU = 55e9, 70e9


def _delta(before: dict, after: dict, *path) -> float:
    a, b = after, before
    for p in path:
        a, b = a.get(p, {}), b.get(p, {})
    return (a or 0) - (b or 0)


def wait_for_placement(m, limit_s: float = 120.0) -> float:
    """Seconds until initial placement has filled pinned RAM (and the GPU's share)."""
    t0 = time.perf_counter()
    total = len(m.store.keys())
    capacity = {tier: row["capacity"] for tier, row in m.stats()["tiers"].items()}
    while time.perf_counter() - t0 < limit_s:
        usable = m.usable_keys()  # slotted tier -> keys whose copy has landed there
        if all(len(keys) >= min(capacity[tier], total) for tier, keys in usable.items()):
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


def run_case(model: str, name: str, cfg: dict, tokens: int, prefill: int, device: str = "cuda",
             label: str | None = None) -> dict:
    from strata import Engine
    from strata.kernels.cpu import experts as ce

    t_load = time.perf_counter()
    engine = Engine.from_pretrained(model, config=cfg, device=device)
    load_s = time.perf_counter() - t_load
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(100 + i * 37) % vocab for i in range(128)]
    engine.generate(prompt, max_tokens=8, temperature=1.0, seed=1)  # warm-up: kernels, graphs, the CPU kernel
    if engine.tiers is not None:
        res_wait = wait_for_placement(engine.tiers)  # measure steady state, not the initial fill
        engine.generate(prompt, max_tokens=8, temperature=1.0, seed=2)
    # decode figures over the decode phase (statistics from the first token on); the 128-token prompt's
    # prefill, slow when its experts are cold, is reported apart as ttft_s
    box = getattr(engine.executor, "mailbox", None)
    c0 = box.counters.copy() if box is not None else None
    ahead = getattr(engine.executor, "warm_ahead", None)
    w0 = ahead.worker.copy() if ahead is not None else None  # the worker's warm-ahead counters so far
    # the CPU kernel's phases over the decode phase (a few clock reads a call), not the prompt's
    run = timed_decode(engine, prompt, tokens, sync, on_first_token=lambda: ce.trace(True))
    kt = ce.trace(False)
    nthreads = box.threads if box is not None else ce.default_threads()
    per_thread = ce.trace_threads(nthreads)  # the same calls, each pool thread's means
    if box is not None:  # the decode phase's trip per layer, from the worker's clock (CpuMailbox.timing)
        d = box.counters - c0
        layers, gaps = max(1, int(d[3])), max(1, int(d[6]))
        mailbox_us = {"serve": round(d[7] / layers / 1e3, 1), "kernel": round(d[2] / layers / 1e3, 1),
                      "gpu_gap": round(d[5] / gaps / 1e3, 1), "layers": int(d[3]),
                      "worker_MB_per_token": round(d[1] / max(1, run.decode_tokens) / 1e6, 1)}  # split experts: part
    before, after, n = run.before, run.after, run.decode_tokens
    res = {"case": label or name, "load_s": round(load_s, 1), "tokens": len(run.tokens), "tok_s": round(run.tok_s, 2),
           "ms_per_token": round(1000 * run.decode_s / n, 2), "ttft_s": round(run.ttft_s, 3)}
    if engine.model.graphs is not None:
        res["graph_replays"] = engine.model.graphs.replays
        res["graph_modes"] = sorted({key[3] for key in engine.model.graphs.graphs})
        res["graph_failures"] = dict(engine.model.graphs.failed)
    if getattr(engine.executor, "gpu_share", None) is not None:
        res["gpu_share"] = round(engine.executor.gpu_share.value, 3)
    if ahead is not None and ahead is getattr(engine.executor, "warm_ahead", None):  # over the decode phase
        w = ahead.worker - w0  # the worker's reads of predicted cold rows into its threads' caches (WarmAhead.stats)
        res["warm_ahead"] = {"warm_bytes": ahead.warm_bytes, "plans_used": int(w[0]), "plans_late": int(w[1]),
                             "read_MB_per_token": round(w[2] / max(1, n) / 1e6, 2),
                             "read_us_per_plan": round(w[3] / max(1, w[0]) / 1e3, 1),
                             "computed_MB_per_token": round(w[4] / max(1, n) / 1e6, 2), "pieces_stolen": int(w[5]),
                             "held_us_per_plan": round(w[6] / max(1, w[0]) / 1e3, 2),
                             "held_us_max": round(ahead.worker[7] / 1e3, 1)}
    if box is not None:
        res["mailbox_threads"] = box.threads  # the worker's kernel threads
        res["mailbox_us_per_layer"] = mailbox_us
    if kt.get("calls"):  # per kernel call: us of each phase (cpu_experts.TRACE_FIELDS), GB/s, chunks
        calls = kt["calls"]
        res["cpu_kernel_us"] = {k[:-3]: round(v / calls / 1e3, 1) for k, v in kt.items() if k.endswith("_ns")}
        res["cpu_kernel_us"].update(calls=calls, gbps=round(kt["bytes"] / max(1, kt["call_ns"]), 1),
                                    threads=round(kt["threads_joined"] / calls, 1),
                                    claimed=round(kt["claimed_ahead"] / calls, 2))
        if per_thread:  # us after the pool ran, each thread (0: the caller): arrived, its warm pieces done, gate/up done
            res["cpu_kernel_threads_us"] = {key[:-3]: [t[key] for t in per_thread]
                                            for key in ("arrived_us", "warm_pieces_us", "phase1_us")}
            res["cpu_kernel_threads_us"]["warm_rows"] = [t["warm_rows"] for t in per_thread]  # rows its read reached
    t0s, t1s = before["tiers"], after["tiers"]
    if t1s is not None:
        lookups = _delta(t0s, t1s, "lookups")
        gpu_hits = _delta(t0s, t1s, "tiers", "gpu", "hits")
        pcie = _delta(t0s, t1s, "paths", "pinned->gpu", "bytes")
        cpu_exp = after["cpu_experts_computed"] - before["cpu_experts_computed"]
        slot = engine.tiers.store.payload_bytes
        res.update(gpu_hit_rate=round(gpu_hits / lookups, 3) if lookups else None,
                   cold_bytes_per_token=int((lookups - gpu_hits) * slot / n),
                   pcie_bytes_per_token=int(pcie / n), cpu_experts_per_token=round(cpu_exp / n, 1),
                   stall_s_per_token=round(_delta(t0s, t1s, "stall_seconds") / n, 4),
                   cpu_GB_s=round(after["cpu_bytes_per_s"] / 1e9, 1), placement_wait_s=round(res_wait, 1),
                   pinned_capacity=t1s["tiers"]["pinned"]["capacity"], gpu_capacity=t1s["tiers"].get("gpu", {}).get("capacity"),
                   hits_by_tier={k: v["hits"] - t0s["tiers"].get(k, {}).get("hits", 0) for k, v in t1s["tiers"].items()},
                   paths={p: {"bytes": v["bytes"], "GB_per_s": v["GB_per_s"]} for p, v in t1s["paths"].items()},
                   prefetch=t1s["prefetch"],
                   cost_model={k: getattr(engine.executor.rates, k) for k in ("cpu_bytes_per_s", "pcie_bytes_per_s",
                                                                             "copy_host_s")},
                   promotions=engine.executor.promotions,
                   cold_path_host_ms_per_token={k: round(1000 * (v - before["cold_path_host_seconds"].get(k, 0.0)) / n, 3)
                                                for k, v in after["cold_path_host_seconds"].items()})
    if prefill and name in ("ceiling", "split", "ceiling_nofolds", "split_nofolds") and (
            label in (None, name) or label.endswith("+grouped")):
        long_prompt = [(100 + i * 7919) % vocab for i in range(prefill)]
        sync()
        t0 = time.perf_counter()
        engine.generate(long_prompt, max_tokens=1, stop_token_ids=[])
        sync()
        res["prefill_tokens"] = prefill
        res["prefill_tok_s"] = round(prefill / (time.perf_counter() - t0), 1)
    engine.close()
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(res, flush=True)
    return res


def add_rooflines(cases: list[dict]) -> None:
    """time per token >= max(GPU time (the ceiling's step), cold bytes / rates of the paths the case may use)."""
    ceiling = next((c for c in cases if c.get("case") == "ceiling" and "tok_s" in c), None)
    gpu_s = 1 / ceiling["tok_s"] if ceiling else 0.0
    rates = {"split": PCIE + CPU, "split_nopromote": PCIE + CPU, "split_nofolds": PCIE + CPU, "split_t14": PCIE + CPU,
             "copy": PCIE, "cpu": CPU}
    for c in cases:
        base = c.get("case", "").split("+")[0]
        if base in rates and "cold_bytes_per_token" in c:
            roof_s = max(gpu_s, c["cold_bytes_per_token"] / rates[base])
            c["roofline_tok_s"] = round(1 / roof_s, 1) if roof_s else None
            c["fraction_of_roofline"] = round(c["tok_s"] * roof_s, 3) if roof_s else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0, help="also time a prompt of this many tokens")
    ap.add_argument("--cases", default="ceiling,ceiling_eager,split,copy,cpu")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--cache", default="/dev/shm/strata-cache")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    args = ap.parse_args()
    from strata.kernels.cpu import experts as ce
    from strata.kernels.gpu import decode_gemv, decode_router, fused
    from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint

    s = summarize_checkpoint(args.model)
    budget = int(s.bytes_by_role["experts"] * args.gpu_fraction)
    disk = {"path": args.cache, "scrub": False}
    ctx = max(1024, args.prefill + 256)
    rt = {"max_context": ctx, "prefill_chunk": min(max(args.prefill, 512), 8192)}
    tiered = {"tiers": {"gpu": {"budget": str(budget)}, "disk": disk}, "runtime": rt}
    all_cases = {
        "ceiling": {"runtime": {**rt, "experts": "memory"}},
        "ceiling_eager": {"runtime": {**rt, "experts": "memory"}, "debug": {"cuda_graphs": False}},
        "ceiling_unfused": {"runtime": {**rt, "experts": "memory"}, "debug": {"fused_kernels": False}},
        "split_unfused": {**tiered, "debug": {"fused_kernels": False}},
        "ceiling_nofolds": {"runtime": {**rt, "experts": "memory"}},
        "split_nofolds": tiered,
        "split": tiered,
        "split_nopromote": {**tiered, "policy": {"promote": False}},  # no background copies of popular CPU experts
        "split_t14": {**tiered, "debug": {"cpu_threads": 14}},  # two cores left to the host step and the copy threads
        "copy": {**tiered, "runtime": {**rt, "cpu_numerics": "gpu"}},
        "cpu": {"tiers": {"gpu": {"budget": "0"}, "disk": disk}, "runtime": rt},
    }
    # the kernels' module flags the modifiers turn off (tests' switches, not settings: set here for each case)
    flags = {"norouter": (decode_router, "ENABLED"), "noresidual": (fused, "RESIDUAL_FOLD"),
             "nogemv": (decode_gemv, "ENABLED"), "noqk": (fused, "QK_FOLD")}
    # [debug] switches the modifiers set: modifier -> (key, value)
    debug_mods = {"nopdl": ("pdl", False), "nowarm": ("warm_ahead", False), "grouped": ("grouped_prefill", True),
                  "sync": ("overlap_decode", False), "host": ("split_decode", "host")}
    result = {"model": args.model, "gpu_fraction": args.gpu_fraction, "expert_bytes": s.bytes_by_role["experts"],
              "gpu_budget_bytes": budget, "cases": []}
    switch = sys.getswitchinterval()

    for full in args.cases.split(","):
        name, *mods = full.split("+")
        if name not in all_cases:
            raise SystemExit(f"unknown case {name!r} in {full!r}; choose from {', '.join(all_cases)}")
        cfg, debug, knobs, off = all_cases[name], {}, {}, set()
        switch_us = spin_us = None
        for mod in mods:
            if mod == "noprefetch":
                cfg = {**cfg, "prefetch": {"lookahead": 0}}
            elif mod in debug_mods:
                key, value = debug_mods[mod]
                debug[key] = value
            elif mod in flags:
                off.add(mod)
            elif mod.startswith("t") and mod[1:].isdigit():
                debug["cpu_threads"] = int(mod[1:])
            elif mod.startswith("sw") and mod[2:].isdigit():
                switch_us = int(mod[2:])
            elif mod.startswith("share"):
                try:
                    debug["gpu_share"] = float(mod[5:])
                except ValueError:
                    raise SystemExit(f"bad modifier {mod!r} in {full!r}: shareX takes a fraction, e.g. share0.3") from None
            elif mod.startswith("spin") and mod[4:].isdigit():
                spin_us = int(mod[4:])
            elif mod.startswith("claim") and mod[5:].isdigit():
                knobs["claim_ahead"] = int(mod[5:])
            elif mod.startswith("chunkdiv") and mod[8:].isdigit():
                knobs["chunk_div"] = int(mod[8:])
            elif mod[:2] in ("ws", "wt") and mod[2:].isdigit():
                knobs["warm_streams" if mod[1] == "s" else "warm_touch"] = int(mod[2:])
            elif mod == "rest0":
                knobs["rest_chunks"] = 0
            elif mod == "rs0":
                knobs["read_split"] = 0
            elif mod in ("dsplit", "dsplit0"):
                knobs["down_split"] = int(mod == "dsplit")
            elif mod != "again":
                raise SystemExit(f"unknown case modifier {mod!r} in {full!r}")
        if debug:  # the modifiers win over the case's own [debug] keys
            cfg = {**cfg, "debug": {**cfg.get("debug", {}), **debug}}
        # the interpreter's GIL switch interval (default 5 ms): how long a thread waiting for the GIL lets the
        # holder run before asking for it; the decode thread re-takes the GIL after every CUDA call and kernel
        sys.setswitchinterval(switch_us / 1e6 if switch_us is not None else switch)
        fused.FOLDS = not name.endswith("_nofolds")
        for mod, (module, flag) in flags.items():
            setattr(module, flag, mod not in off)
        if spin_us is not None:
            ce.configure(spin_us=spin_us)
        old_knobs = ce.tune(**knobs)  # the kernel's scheduling knobs for this case only
        try:
            result["cases"].append(run_case(args.model, name, cfg, args.tokens, args.prefill, args.device, label=full))
        except Exception as e:  # noqa: BLE001 - record and go on to the next case
            result["cases"].append({"case": full, "error": f"{type(e).__name__}: {e}"})
            print(full, "failed:", e, flush=True)
            traceback.print_exc()
        ce.tune(**old_knobs)
        if spin_us is not None:  # back to the default for the next case
            ce.configure(spin_us=ce.spin_us())
    sys.setswitchinterval(switch)
    fused.FOLDS = True
    for module, flag in flags.values():
        setattr(module, flag, True)
    add_rooflines(result["cases"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hotpath.json").write_text(json.dumps(result, indent=2))
    for c in result["cases"]:
        print(json.dumps(c))


if __name__ == "__main__":
    main()

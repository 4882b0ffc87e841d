"""Run strata cases: one engine per variant/budget/routing, every workload of the group on it.

Each workload submits its streams to the engine's continuous-batching scheduler at once (the path
`strata serve` uses; sampling at temperature 1 with fixed seeds and `ignore_eos`, so every stream
generates exactly its tokens and routing does not settle into a greedy loop), timestamps every token,
and snapshots the tier counters when the last stream has its first token: the prefill phase before
that moment, the decode phase after it.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path

import torch

from bench.suite.case_config import engine_config
from bench.suite.cases import COLD_PATHS, Case, Workload
from bench.suite.roofline import ModelFacts, Rates, fraction, roofline
from bench.tools.kernel_trace import traced
from strata.runtime.offload.mailbox import CpuMailbox


def prompts_for(w: Workload, vocab: int, seed: int = 0) -> list[list[int]]:
    """One prompt per stream: random ids from the demo tokenizer's ordinary tokens (fixed seed)."""
    g = torch.Generator().manual_seed(seed + 7919 * w.prompt)
    hi = min(vocab, 8000)
    return [torch.randint(300, hi, (w.prompt,), generator=g).tolist() for _ in range(w.streams)]


def wait_placed(engine, timeout: float) -> float:
    """Wait until initial placement has filled the GPU and pinned tiers (or stopped growing); seconds waited."""
    if engine.tiers is None:
        return 0.0
    t0, last, still = time.perf_counter(), None, 0
    while time.perf_counter() - t0 < timeout:
        tiers = engine.tiers.stats()["tiers"]
        state = tuple((t, v["resident"]) for t, v in sorted(tiers.items()) if t in ("gpu", "pinned"))
        full = all(v["resident"] >= v["capacity"] for t, v in tiers.items() if t in ("gpu", "pinned"))
        if full:
            break
        still = still + 1 if state == last else 0
        if still >= 20:  # 2 s without progress: placement is done (a tier bigger than the model)
            break
        last = state
        time.sleep(0.1)
    # then the background work itself (fills, pool registration, copies in flight), so that a group's first case
    # does not run beside it (a skewed split case run first on its engine once saw the CPU kernel at a third of
    # its later rate with placement reported done at once; whether this was the cause is not known)
    settle = getattr(engine.tiers, "wait_settled", None)
    if settle is not None:
        settle(max(0.0, timeout - (time.perf_counter() - t0)))
    return round(time.perf_counter() - t0, 2)


class _Peaks:
    """Peak VRAM (torch allocator, and the device as a whole) and peak RSS over a workload."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
        except OSError:
            pass

    def read(self) -> dict:
        out = {"peak_vram_bytes": None, "vram_used_bytes": None, "peak_rss_bytes": None}
        if self.cuda:
            out["peak_vram_bytes"] = torch.cuda.max_memory_allocated()
            free, total = torch.cuda.mem_get_info()
            out["vram_used_bytes"] = total - free
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out["peak_rss_bytes"] = int(line.split()[1]) * 1024
        except OSError:
            import psutil

            out["peak_rss_bytes"] = psutil.Process().memory_info().rss
        return out


def _snapshot(engine) -> dict:
    st = engine.stats()
    t = st.get("tiers") or {}
    # bytes each tier path moved (warm-ahead's reads stay in host RAM: no path of their own)
    paths = {k: v.get("bytes", 0) for k, v in (t.get("paths") or {}).items()}
    timing = (st.get("one_graph_decode") or {}).get("timing") or {}
    return {"lookups": t.get("lookups", 0), "stall": t.get("stall_seconds", 0.0),
            "hits": {k: v.get("hits", 0) for k, v in (t.get("tiers") or {}).items()},
            "paths": paths,
            "cpu_experts": st.get("cpu_experts_computed", 0), "promotions": st.get("promotions", 0),
            "host": dict(st.get("cold_path_host_seconds") or {}),
            "mailbox": timing.get("totals"),  # the one-graph worker's running sums (None: not running)
            "captures": getattr(getattr(getattr(engine, "model", None), "graphs", None), "captures", 0)}  # graphs so far


def _delta(a: dict, b: dict) -> dict:
    return {"lookups": b["lookups"] - a["lookups"], "stall": b["stall"] - a["stall"],
            "hits": {k: b["hits"].get(k, 0) - a["hits"].get(k, 0) for k in b["hits"]},
            "paths": {k: b["paths"].get(k, 0) - a["paths"].get(k, 0) for k in b["paths"]},
            "cpu_experts": b["cpu_experts"] - a["cpu_experts"], "promotions": b["promotions"] - a["promotions"],
            "host": {k: v - a["host"].get(k, 0.0) for k, v in b["host"].items()},
            "mailbox": CpuMailbox.window(a["mailbox"] or {}, b["mailbox"]) if b.get("mailbox") else None,
            "captures": b["captures"] - a["captures"]}


def run_workload(engine, scheduler, w: Workload, vocab: int, device: str, reproducible: bool = False) -> dict:
    """Measure one workload on a started scheduler (`reproducible`: every request asks for bit-identical results);
    returns metrics and the decode-phase counters."""
    from strata.runtime.generation.sampler import SamplingParams
    from strata.runtime.generation.scheduler import GenRequest

    prompts = prompts_for(w, vocab)
    peaks = _Peaks(device)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)  # token timestamps are taken by the consumer threads: let them run promptly
    peaks.reset()
    stamps: list[list[float]] = [[] for _ in range(w.streams)]
    started, lock, mid = [0], threading.Lock(), {}
    s0 = _snapshot(engine)
    t0 = time.perf_counter()
    handles: list = []

    def collect(i: int) -> None:
        for ev in handles[i].iter_events(timeout=3600):
            if ev.token_id is None:
                continue
            stamps[i].append(time.perf_counter())
            if len(stamps[i]) == 1:
                with lock:
                    started[0] += 1
                    if started[0] == w.streams:  # every stream is decoding: the decode phase starts
                        mid["t"], mid["snap"] = time.perf_counter(), _snapshot(engine)
            if ev.finish_reason == "abort":
                raise RuntimeError("the scheduler aborted a stream")

    threads = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(w.streams)]
    try:
        for i, (t, p) in enumerate(zip(threads, prompts, strict=True)):
            params = SamplingParams(max_tokens=w.tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
            handles.append(scheduler.submit(GenRequest(p, params, reproducible=reproducible)))
            t.start()  # consuming at once: a token's timestamp is when its event arrives
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    s2 = _snapshot(engine)
    if "t" not in mid or any(len(s) < 2 for s in stamps):
        raise RuntimeError(f"streams produced {[len(s) for s in stamps]} tokens; expected {w.tokens} each")
    t_mid = mid["t"]
    window_tokens = sum(1 for s in stamps for x in s if x > t_mid)
    decode = _delta(mid["snap"], s2)
    prefill = _delta(s0, mid["snap"])
    per_stream = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps]
    ttft = [s[0] - t0 for s in stamps]
    n = max(1, window_tokens)
    hits_gpu = decode["hits"].get("gpu", 0)
    metrics = {
        "tokens": sum(len(s) for s in stamps),
        "decode_window_tokens": window_tokens,
        "decode_tok_s": round(window_tokens / (t_end - t_mid), 3) if window_tokens else round(per_stream[0], 3),
        "slowest_stream_tok_s": round(min(per_stream), 3),
        "mean_stream_tok_s": round(sum(per_stream) / len(per_stream), 3),
        "prefill_tok_s": round(sum(len(p) for p in prompts) / (t_mid - t0), 1),
        "ttft_s": round(max(ttft), 4),
        "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
        "gpu_hit_rate": round(hits_gpu / decode["lookups"], 4) if decode["lookups"] and "gpu" in decode["hits"] else None,
        "lookups_per_token": round(decode["lookups"] / n, 2),
        "hits_per_token": {k: round(v / n, 2) for k, v in decode["hits"].items()},
        "bytes_per_token": {k: int(v / n) for k, v in decode["paths"].items() if v},
        "prefill_bytes_per_prompt_token": {k: int(v / max(1, sum(map(len, prompts)))) for k, v in prefill["paths"].items() if v},
        "cpu_experts_per_token": round(decode["cpu_experts"] / n, 3),
        "promotions_per_token": round(decode["promotions"] / n, 3),
        # the decode layers' host work by phase (strata.runtime.offload.tiered_moe), where a tiered step's time goes
        "cold_path_host_ms_per_token": {k: round(1000 * v / n, 3) for k, v in decode["host"].items() if v},
        "stall_s_per_token": round(decode["stall"] / n, 6),
        "stall_s_total": round(decode["stall"] + prefill["stall"], 4),
        "wall_s": round(t_end - t0, 3),
        # decode modes whose CUDA-graph capture failed (they ran eagerly): why, and where
        "graph_failures": dict(getattr(getattr(engine.model, "graphs", None), "failed", None) or {}),
        # decode graphs captured inside the timed decode window: the warm-up should leave none (a capture, and on a
        # fresh box the JIT builds of its kernels, take far longer than a step)
        "graph_captures_in_decode": decode["captures"],
        "decode_state": decode_state(engine),
        # the one-graph worker's layer trip over the decode window alone (decode_state's `timing` averages every
        # layer since start-up, prefill and warm-up included)
        "mailbox_window": decode["mailbox"],
        **peaks.read(),
        # of that peak, the KV cache the planner reserved for the engine's max_batch x max_context (the suite sizes
        # one engine for its group's largest workload, so a 128-token case holds the 8K case's cache)
        "kv_reserved_bytes": engine.plan.kv_bytes if engine.plan is not None and peaks.cuda else None,
    }
    return {"metrics": metrics, "decode": decode, "window_tokens": window_tokens}


def decode_state(engine) -> dict:
    """How the engine decoded at the end of a workload: its CUDA graphs' mode ("full": one graph a step;
    "segmented": host steps between graphs; None: eager), captures and replays, and the lookahead
    prefetcher's state (idle for good once its tier holds every expert; pauses; prefetch counters), and the
    split's cost-model rates, CPU-share mode and kernel thread count, and the one-graph (mailbox) decode's state."""
    g = getattr(engine.model, "graphs", None)
    compute = engine.executor
    p = getattr(compute, "prefetcher", None)
    tiers = engine.stats().get("tiers") or {}
    return {"graph_mode": g.mode() if g is not None else None, "graph_captures": g.captures if g is not None else 0,
            "graph_replays": g.replays if g is not None else 0,
            "prefetcher": None if p is None else {"idle": bool(p.idle()) if p.idle is not None else False,
                                                  "pauses": p.pauses, "target": p.device_tier},
            "prefetch": tiers.get("prefetch"),
            "promotions": tiers.get("promotions"),  # done, the worker's host ms each, clears behind a copy
            # the split's cost model as it ended (what it believed about the paths when choosing)
            "cost_model": None if compute is None else {
                k: getattr(compute.rates, k) for k in ("cpu_bytes_per_s", "pcie_bytes_per_s", "copy_host_s",
                                                       "stage_fixed_s")},
            "cpu_async": None if compute is None else compute.cpu_async,
            "cpu_threads": None if compute is None else compute.cpu_threads,
            "one_graph_decode": engine.stats().get("one_graph_decode")}


def case_roofline(case: Case, res: dict, facts: ModelFacts, rates: Rates) -> dict | None:
    """The roofline for the decode phase of `res` (None when nothing was decoded in the window)."""
    tokens = res["window_tokens"]
    if not tokens:
        return None
    steps = max(1, round(tokens / case.workload.streams))
    d = res["decode"]
    if case.variant == "ceiling" or not d["lookups"]:
        gpu_experts, cold, disk = facts.expected_experts_per_step(case.workload.streams) * steps, 0, 0
        paths: tuple[str, ...] = ()
    else:
        hits = d["hits"]
        disk = hits.get("disk", 0)
        cold = d["lookups"] - hits.get("gpu", 0) - disk
        gpu_experts = d["lookups"] - d["cpu_experts"]
        paths = COLD_PATHS.get(case.variant, ("pcie", "cpu"))
    return roofline(tokens=tokens, steps=steps, gpu_experts=gpu_experts, cold_experts=cold, disk_experts=disk,
                    facts=facts, rates=rates, paths=paths)


def pinned_shortfall(stats: dict | None, case: Case) -> str | None:
    """Why a case meant to hold every expert in pinned RAM did not (None when it did): experts beyond pinned
    RAM's capacity are read from the disk tier, so the case measures another machine than it says (on the
    H200 box: a /dev/shm still full of other models gave a "split" decode of 17 tok/s, 4.2x its roofline). A case
    with every expert in VRAM reads nothing from pinned RAM (the planner leaves it a few staging slots), and the disk
    case is short on purpose."""
    if stats is None or case.gpu_fraction is None or case.ram_fraction is not None:
        return None
    tiers = stats.get("tiers", {})
    total, pinned = tiers.get("disk", {}).get("capacity", 0), tiers.get("pinned", {}).get("capacity", 0)
    if total and pinned < total:
        return (f"host RAM short: only {pinned} of {total} experts fit in pinned RAM, the rest would be read from "
                "the disk tier; free RAM (e.g. old models and stores in /dev/shm) and run the case again")
    return None


def run_group(cases: list[Case], model: Path, summary: dict, facts: ModelFacts, rates: Rates, settings: dict,
              deadline: float, log=print, popularity: dict | None = None) -> list[dict]:
    """Load one engine for `cases` (same variant, budget, routing), run each workload; one record per case."""
    from strata import Engine

    first = cases[0]
    cfg = engine_config(first, summary, settings, [c.workload for c in cases])
    device = settings["device"]
    records = []
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, config=cfg, device=device)
    sched = None
    try:
        load_s = round(time.perf_counter() - t0, 2)
        placed_s = wait_placed(engine, settings["placement_timeout"])
        if (short := pinned_shortfall(engine.tiers.stats() if engine.tiers is not None else None, first)) is not None:
            for case in cases:
                records.append(record(case, "skipped", short, config=cfg))
                log(_line(records[-1]))
            return records
        vocab = engine.checkpoint.config.vocab_size
        sched = engine.scheduler(max_batch=max(c.workload.streams for c in cases), token_budget=settings["token_budget"])
        sched.start()
        if popularity is not None:  # once per routing, outside any timed run: how this checkpoint routes
            popularity.update(measure_popularity(engine, sched, vocab, summary))
        # warm-up: kernels, graphs, first copies, and the tier policy's first counts and promotions
        repro = first.variant == "repro"
        run_workload(engine, sched, Workload(64, 1, 16), vocab, device, repro)
        warmed = {(64, 1)}
        for case in cases:
            if time.time() > deadline:
                records.append(record(case, "skipped", "the suite's deadline passed (--deadline)", config=cfg))
                continue
            if case.workload.prompt + case.workload.tokens > engine.max_context:
                records.append(record(case, "skipped", f"prompt + tokens exceed the model's context of "
                                                       f"{engine.max_context} tokens", config=cfg))
                continue
            try:
                warm = warmup_for(case.workload, warmed)
                if warm is not None:  # a new batch size or prompt length: its decode graphs are captured here,
                    run_workload(engine, sched, warm, vocab, device, repro)  # not inside the timed run
                with traced(device):  # $STRATA_BENCH_TRACE: the kernels' summary (bench/tools/kernel_trace.py)
                    res = median_run([run_workload(engine, sched, case.workload, vocab, device, repro)
                                      for _ in range(max(1, settings.get("repeats", 1)))])
                res["metrics"]["warmup"] = None if warm is None else {"prompt": warm.prompt, "streams": warm.streams,
                                                                     "tokens": warm.tokens}
                bound = case_roofline(case, res, facts, rates)
                m = res["metrics"]
                m.update(load_s=load_s, placement_wait_s=placed_s)
                late = {"note": f"{m['graph_captures_in_decode']} decode graph(s) captured inside the timed decode "
                                "(a shape the warm-up missed): its decode figures are low"} \
                    if m["graph_captures_in_decode"] else {}
                records.append(record(case, "ok", None, metrics=m, roofline=bound, config=cfg,
                                      fraction_of_roofline=fraction(m["decode_tok_s"], bound), **late))
            except Exception as e:  # noqa: BLE001 - record and go on
                records.append(record(case, "error", f"{type(e).__name__}: {e}", config=cfg))
            log(_line(records[-1]))
    finally:
        if sched is not None:
            sched.stop(drain=False, timeout=30)
        engine.close()
        del engine
        gc.collect()
        if device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records


def median_run(runs: list[dict]) -> dict:
    """The run (of `run_workload`'s results) with the median decode rate, its metrics also holding every run's decode
    and prefill rates (`decode_tok_s_runs`, `prefill_tok_s_runs`, in run order). A fast case's decode window is a
    fraction of a second (64 tokens at 500 tok/s: 0.13 s), which one background hiccup of the host can halve."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["metrics"]["decode_tok_s"])
    chosen = runs[order[len(order) // 2]]
    if len(runs) > 1:
        chosen["metrics"]["decode_tok_s_runs"] = [r["metrics"]["decode_tok_s"] for r in runs]
        chosen["metrics"]["prefill_tok_s_runs"] = [r["metrics"]["prefill_tok_s"] for r in runs]
    return chosen


def warmup_for(w: Workload, warmed: set[tuple[int, int]]) -> Workload | None:
    """An untimed run of `w`'s shape (same streams, same prompt length: the same decode batch sizes and KV bucket, so
    the same CUDA graphs) when no earlier run had it, else None; records the shape in `warmed`. One stream: a few
    tokens. Several: all of `w`'s tokens, because their prompts prefill in chunks, so the streams start and finish
    decoding steps apart, and the timed run's last steps decode fewer streams than it has; a short warm-up left those
    batch sizes' graphs to be captured inside the timed decode (on a fresh box with their kernels' JIT builds: the
    25% uniform 4-stream case then ran at ~50 tok/s against ~200 in later runs)."""
    key = (w.prompt, w.streams)
    if key in warmed:
        return None
    warmed.add(key)
    return Workload(w.prompt, w.streams, 4 if w.streams == 1 else w.tokens)


def measure_popularity(engine, sched, vocab: int, summary: dict) -> dict:
    """The routing of a short eager workload on `engine`: each layer's expert popularity and the overlap of
    consecutive tokens' choices (summarised with `summary`'s experts per layer), its decode graphs off meanwhile."""
    from bench.suite.routing import popularity_summary, record_choices, temporal_overlap

    # the counting hooks copy router ids to the host, which a CUDA-graph capture cannot contain: run these
    # steps eagerly, or the first decode step's capture fails and the engine decodes eagerly for good
    graphs = engine.model.graphs
    mode = graphs.mode if graphs is not None else None
    if graphs is not None:
        graphs.mode = lambda: None
    try:
        with record_choices(engine.model) as choices:
            run_workload(engine, sched, Workload(256, 1, 2), vocab, "cpu")
    finally:
        if graphs is not None:
            graphs.mode = mode
    if not choices:
        return {}
    experts = summary["experts_per_layer"]
    out = popularity_summary({layer: torch.bincount(torch.cat(ids).reshape(-1), minlength=experts)
                              for layer, ids in choices.items()})
    # temporal locality over the prompt's tokens (its chunks in order: one sequence a layer)
    prompts = [torch.cat(p) for p in ([c for c in cs if c.shape[0] > 1] for cs in choices.values()) if p]
    if prompts:
        overlaps = [temporal_overlap([ids], experts) for ids in prompts]
        for key in ("consecutive", "independent"):
            out[f"{key}_overlap"] = round(sum(o[key] for o in overlaps) / len(overlaps), 4)
    return out


def record(case: Case, status: str, reason: str | None, **fields) -> dict:
    """A case record as the JSON holds it."""
    w = case.workload
    return {"name": case.name, "variant": case.variant, "routing": case.routing, "group": case.group,
            "budget": {"gpu_fraction": case.gpu_fraction, "ram_fraction": case.ram_fraction},
            "workload": {"prompt": w.prompt, "streams": w.streams, "tokens": w.tokens},
            "status": status, "reason": reason, **fields}


def _line(rec: dict) -> str:
    if rec["status"] != "ok":
        return f"{rec['name']}: {rec['status']} ({rec['reason']})"
    m, f = rec["metrics"], rec.get("fraction_of_roofline")
    hit = m.get("gpu_hit_rate")
    return (f"{rec['name']}: decode {m['decode_tok_s']} tok/s (slowest {m['slowest_stream_tok_s']}), "
            f"prefill {m['prefill_tok_s']} tok/s, hit {hit}, roofline fraction {f}")

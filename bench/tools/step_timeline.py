"""Where a one-graph split decode step's time goes, end to end: the host's clock, the GPU's events and the mailbox
worker's clock on one timeline (all CLOCK_MONOTONIC).

    python bench/tools/step_timeline.py --model DIR [--gpu-fraction 0.25] [--tokens 48] [--cases split,ceiling]
                                        [--out DIR]

Modifiers (`split+spin100+nobooks`): shareX (debug.gpu_share = X), swN (GIL switch interval, us), spinN (the kernel's
idle spin, us), wspinN (the mailbox worker's polling spin, us), tN (the kernel's threads, debug.cpu_threads = N),
nowarm (warm-ahead off, debug.warm_ahead = false), nopromote, nobooks, wakeatlaunch (the books woken right after the
replay, not once the step's LM head is queued).

The worker's per-layer timing (serve, GPU gap) covers a step's MoE layers; these cover the rest of a token (ms):
  host_between      the sampler: from the previous step's logits done to this token on the host
  launch            from the token on the host to `model(...)` returning (the graph enqueued, and what follows it)
  to_first_from_back  from the token on the host to the worker seeing the first MoE layer's `ready`
  layers            from there to the last MoE layer's `done` (every layer's CPU share and the GPU between them)
  tail              from the last `done` to the step's logits done on the host (the graph's end, the LM head)
  step_gpu, logits_gpu  GPU event time of the step and of its LM head; token: a whole token, wall
  sample_alone      the sampler alone on the last logits, after the loop
Medians over the decode steps (the first few, which may capture graphs, are dropped). Writes step_timeline.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timeline(engine, prompt: list[int], tokens: int, seed: int = 3, wake_at_launch: bool = False) -> dict:
    """Decode `tokens` tokens of `prompt` (temperature 1, seeded) and time each step's phases (`wake_at_launch`:
    the books woken right after the replay instead of once the step's LM head is queued)."""
    from strata.runtime.generation.prefill import prefill
    from strata.runtime.generation.sampler import SamplingParams, make_generator, sample
    from strata.runtime.model.kv_cache import StepBatch

    model, cache, dev = engine.model, engine.scheduler().cache, engine.device  # slot 0 of the engine's KV cache
    box = getattr(engine.executor, "mailbox", None)
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True)
    gen = make_generator(seed, dev)
    now = time.monotonic_ns
    rows = []
    c0 = c = box.counters.copy() if box is not None else None
    books0 = engine.executor.books.seconds if box is not None else 0.0
    with torch.inference_mode():
        logits = prefill(model, cache, 0, torch.tensor(prompt, dtype=torch.long, device=dev),
                         engine.prefill_chunk)
        torch.cuda.synchronize()
        pos = len(prompt)
        t_token = now()
        for _ in range(tokens):
            token = int(sample(logits[None], params, gen)[0])  # waits for the last step's logits and sampling
            t_back = now()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            hidden = model(torch.tensor([token], dtype=torch.long, device=dev), StepBatch([0], [pos], [1]), cache)
            if wake_at_launch and model.graphs is not None:
                model.graphs.step_queued()  # the books woken at the replay (the older order)
            t_enq = now()
            ev[1].record()
            logits = model.logits(hidden)[0]
            ev[2].record()
            if model.graphs is not None:
                model.graphs.step_queued()  # as `queue_decode` does once the step's work is queued
            t_logits_enq = now()
            torch.cuda.synchronize()
            t_done = now()
            c_prev, c = c, box.counters.copy() if box is not None else None
            rows.append({**({"kernel_ms": (int(c[2]) - int(c_prev[2])) / 1e6, "cpu_experts": int(c[0] - c_prev[0])}
                            if c is not None else {}),
                         "host_between_ms": (t_back - t_token) / 1e6,  # previous token back -> this one sampled
                         "launch_ms": (t_enq - t_back) / 1e6,
                         "step_gpu_ms": ev[0].elapsed_time(ev[1]), "logits_gpu_ms": ev[1].elapsed_time(ev[2]),
                         "enqueue_logits_ms": (t_logits_enq - t_enq) / 1e6, "step_wall_ms": (t_done - t_back) / 1e6,
                         **({"to_first_ms": (int(c[8]) - t_enq) / 1e6, "to_first_from_back_ms": (int(c[8]) - t_back) / 1e6,
                             "layers_ms": (int(c[9]) - int(c[8])) / 1e6, "tail_ms": (t_done - int(c[9])) / 1e6}
                            if c is not None and c[8] > t_back else {})})
            t_token = t_done
            pos += 1
        t0 = now()
        for _ in range(8):  # the sampler alone, on the last logits (its GPU kernels and the host's work)
            int(sample(logits[None], params, gen)[0])
        sample_ms = (now() - t0) / 8e6
    keep = rows[4:] if len(rows) > 8 else rows
    med = {k: round(statistics.median(r[k] for r in keep if k in r), 3) for k in keep[0] if any(k in r for r in keep)}
    wall = [rows[i + 1]["host_between_ms"] + rows[i + 1]["step_wall_ms"] for i in range(3, len(rows) - 1)]
    med["sample_alone_ms"] = round(sample_ms, 3)
    if "kernel_ms" in keep[0]:  # a step's CPU kernel time: a mean far above the median is a few stalled steps
        k = sorted(r["kernel_ms"] for r in keep)
        med["kernel_ms_p90"], med["kernel_ms_mean"] = round(k[int(0.9 * (len(k) - 1))], 3), round(sum(k) / len(k), 3)
    med["token_ms"] = round(statistics.median(wall), 3) if wall else None
    out = {"median": med, "steps": len(rows)}
    if box is not None:  # the worker's clock over the prompt and the steps (CpuMailbox.timing), the books' Python
        d = box.counters - c0
        layers, gaps = max(1, int(d[3])), max(1, int(d[6]))
        out["mailbox_us_per_layer"] = {"serve": round(d[7] / layers / 1e3, 1), "kernel": round(d[2] / layers / 1e3, 1),
                                       "gpu_gap": round(d[5] / gaps / 1e3, 1), "cpu_experts_per_layer":
                                       round(int(d[0]) / layers, 2)}
        out["books_ms_per_step"] = round(1e3 * (engine.executor.books.seconds - books0) / len(rows), 3)
    return out


def case_configs(model: str, gpu_fraction: float, cache: str) -> dict[str, dict]:
    """The two base cases' engine configs: `ceiling` (every expert in VRAM) and `split` (a GPU budget of
    `gpu_fraction` of the checkpoint's expert bytes, the rest in pinned RAM, the store cached at `cache`)."""
    from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint

    summary = summarize_checkpoint(model)
    budget = int(summary.bytes_by_role["experts"] * gpu_fraction)
    rt = {"max_context": 1024}
    # quantized experts loaded into the model would be dequantized to bf16: all in VRAM they keep GPU slots instead
    quantized = summary.expert_format is not None and summary.expert_format.quantized
    return {"ceiling": {"runtime": {**rt, "experts": "tiered" if quantized else "memory"}},
            "split": {"tiers": {"gpu": {"budget": str(budget)}, "disk": {"path": cache, "scrub": False}},
                      "runtime": rt}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cases", default="split,ceiling")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--cache", default="/dev/shm/sc")
    args = ap.parse_args()
    from bench.tools.hotpath import wait_for_placement
    from strata import Engine
    configs = case_configs(args.model, args.gpu_fraction, args.cache)
    out = {"model": args.model, "cases": []}
    from strata.kernels.cpu import experts as ce
    from strata.runtime.offload import mailbox as cpu_mailbox

    switch, wspin = sys.getswitchinterval(), cpu_mailbox.SPIN_NS
    for case in args.cases.split(","):
        name, *mods = case.split("+")
        cfg, debug = configs[name], {}
        sys.setswitchinterval(switch)
        ce.configure(spin_us=ce.spin_us())
        cpu_mailbox.SPIN_NS = wspin
        for mod in mods:  # A/B modifiers for one run
            if mod.startswith("share"):  # a fixed GPU share of the cold experts (hotpath's modifier)
                debug["gpu_share"] = float(mod.removeprefix("share"))
            elif mod.startswith("sw"):  # the interpreter's GIL switch interval, us
                sys.setswitchinterval(int(mod[2:]) / 1e6)
            elif mod.startswith("spin"):  # how long the CPU kernel's idle workers spin, us
                ce.configure(spin_us=int(mod[4:]))
            elif mod.startswith("wspin"):  # how long the mailbox worker polls without sleeping after a layer, us
                cpu_mailbox.SPIN_NS = int(mod[5:]) * 1000
            elif mod[0] == "t" and mod[1:].isdigit():  # the mailbox kernel's threads
                debug["cpu_threads"] = int(mod[1:])
            elif mod == "nopromote":
                cfg = {**cfg, "policy": {"promote": False}}
            elif mod == "nowarm":  # warm-ahead off (on by default)
                debug["warm_ahead"] = False
            elif mod not in ("nobooks", "wakeatlaunch"):
                raise SystemExit(f"unknown modifier {mod!r}")
        if debug:
            cfg = {**cfg, "debug": debug}
        engine = Engine.from_pretrained(args.model, config=cfg, device="cuda")
        vocab = engine.checkpoint.config.vocab_size
        prompt = [(100 + i * 37) % vocab for i in range(128)]
        engine.generate(prompt, max_tokens=8, temperature=1.0, seed=1)
        if engine.tiers is not None:
            wait_for_placement(engine.tiers)
            engine.generate(prompt, max_tokens=8, temperature=1.0, seed=2)
        if "nobooks" in mods and engine.executor.books is not None:  # no bookkeeping at all during the steps
            engine.executor.books.queued = lambda until=None: None
        res = {"case": case, **timeline(engine, prompt, args.tokens, wake_at_launch="wakeatlaunch" in mods)}
        if engine.model.graphs is not None:
            res["graph_modes"] = sorted({key[3] for key in engine.model.graphs.graphs})
        if (share := getattr(engine.executor, "gpu_share", None)) is not None:
            res["gpu_share"] = round(share.value, 3)
        if (ahead := getattr(engine.executor, "warm_ahead", None)) is not None:
            res["warm_ahead"] = ahead.stats()  # (over the whole run, warm-up included)
        out["cases"].append(res)
        print(json.dumps(res), flush=True)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_timeline.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

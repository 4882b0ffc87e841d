"""Where a long prompt's prefill time goes: torch.profiler over one N-token prefill (one chunk).

    python bench/tools/profile_prefill.py --model DIR [--prompt 8192] [--chunk N] [--config JSON] [--out DIR]
                                          [--label NAME]

Prints the wall time, tok/s and the top CUDA kernels by total time (GEMMs against gathers, index_add,
attention, copies), and writes profile_prefill-LABEL.txt. The target is 3,000 tok/s for an 8K prompt
at a 25% GPU budget on the 48-layer bench model; the same model all in VRAM bounds it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=0,
                    help="runtime.prefill_chunk (0: the whole prompt; -1: the config's, by default \"auto\")")
    ap.add_argument("--config", default='{"runtime": {"experts": "memory"}}')
    ap.add_argument("--label", default="ceiling")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from bench.suite.cases import Workload
    from bench.suite.strata_case import prompts_for
    from strata import Engine

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    cfg = json.loads(args.config)
    # the same prompt runs three times: the prefix cache would serve the later ones
    cfg.setdefault("runtime", {}).update({"max_context": args.prompt + 64, "prefix_cache": False})
    if args.chunk >= 0:  # -1: the config's runtime.prefill_chunk (its default: "auto")
        cfg["runtime"]["prefill_chunk"] = args.chunk or args.prompt
    engine = Engine.from_pretrained(args.model, config=cfg, device=args.device)
    engine.wait_settled()
    vocab = engine.checkpoint.config.vocab_size
    prompt = prompts_for(Workload(args.prompt, 1, 1), vocab)[0]  # the suite's prompt of this length
    engine.generate(prompt[:1024], max_tokens=1, temperature=0.0)  # warm-up: kernels compiled, allocator grown
    sync()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    engine.generate(prompt, max_tokens=1, temperature=0.0)
    sync()
    plain = time.perf_counter() - t0
    # VRAM the prefill took beyond what was allocated before it (activations; the KV cache is allocated up front)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompt, max_tokens=1, temperature=0.0)
        sync()
        profiled = time.perf_counter() - t0
    head = (f"{args.label}: {args.prompt} tokens prefilled in {plain:.3f} s ({args.prompt / plain:,.0f} tok/s, chunks of "
            f"{engine.prefill_chunk}); {profiled:.3f} s profiled; peak {peak / 2**20:,.0f} MiB above the start "
            f"({peak / 1024 / engine.prefill_chunk:,.0f} KiB a chunk token)")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(head, flush=True)
    print(table[:6000], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"profile_prefill-{args.label}.txt").write_text(f"{head}\n{table}\n\n{cpu}")
    engine.close()


if __name__ == "__main__":
    main()

"""Qwen3.5-MoE's decode on the CPU at a long context against a short one: the linear-attention layers' state makes a
decode step's cost independent of the context on those layers, so only the full-attention layers (one in four)
read more at 8K than at 512.

    python bench/linear_attention_decode.py [--model DIR] [--short 512] [--long 8192] [--tokens 48] [--rounds 3]
                                            [--size small] [--out DIR]

Writes the `small` (--size) Qwen3.5-MoE demo model (strata demo-model --arch qwen3_5_moe --size small, ~450 MB: 8 layers, 6
Gated DeltaNet and 2 gated full-attention, 64 experts of 256) into --model when it is not there, loads it with the
default configuration on the CPU (tiered experts, every one in RAM; runtime.dtype "auto": the checkpoint's bf16),
`runtime.max_context` = --long + --tokens + 16, then runs --rounds rounds, each a greedy generation of --tokens tokens
after a --short-token prompt and one after a --long-token prompt (alternating, so a busy host's noise falls on both).
A context's per-token decode time is the engine's own timer of its decode steps (`Engine.stats()`: decode seconds
over decode tokens, the first token, computed by the prompt's last pass, left out); the figure is its median over
the rounds, and the ratio long / short the target (<= 1.3).

Prints the figures as JSON and writes them to --out/linear_attention_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import commit  # noqa: E402

TARGET = 1.3  # long-context decode time over short-context decode time


def decode_ms(engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(ms per decode token, prefill tok/s) of one greedy generation of `tokens` tokens after `prompt`."""
    before = engine.counters.snapshot()
    out = engine.generate(prompt, max_tokens=tokens, temperature=0.0, stop_token_ids=[])
    after = engine.counters.snapshot()
    steps = after["decode_tokens"] - before["decode_tokens"]
    if len(out.token_ids) != tokens or steps != tokens - 1:
        raise RuntimeError(f"expected {tokens} tokens ({tokens - 1} decode steps), got {len(out.token_ids)} ({steps})")
    prefill = (after["prompt_tokens"] - before["prompt_tokens"]) / (after["prefill_seconds"] - before["prefill_seconds"])
    return 1000 * (after["decode_seconds"] - before["decode_seconds"]) / steps, prefill



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path.home() / ".cache" / "strata" / "bench" / "qwen3_5_moe-small"),
                   help="the small Qwen3.5-MoE demo model's directory (written when missing)")
    p.add_argument("--short", type=int, default=512, help="short prompt tokens")
    p.add_argument("--long", type=int, default=8192, help="long prompt tokens")
    p.add_argument("--tokens", type=int, default=48, help="tokens generated after each prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="small", help="the demo model's size when it is written (tests: tiny)")
    p.add_argument("--out", default=None, help="directory for linear_attention_decode.json")
    args = p.parse_args(argv)

    import torch

    from strata import Engine
    from strata.runtime.demo.model import write_demo_model

    model = write_demo_model(args.model, size=args.size, arch="qwen3_5_moe", progress=True)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, device="cpu",
                                    config={"runtime": {"max_context": args.long + args.tokens + 16}})
    load_s = time.perf_counter() - t0
    engine.tiers.wait_settled()  # every expert placed in RAM before anything is timed
    vocab = engine.checkpoint.config.vocab_size
    prompts = {n: [(7919 * i + 13 * n) % (vocab - 3) + 3 for i in range(n)] for n in (args.short, args.long)}
    decode_ms(engine, prompts[args.short][:64], 8)  # warm-up: the kernels' first calls
    rounds: dict[int, list[float]] = {n: [] for n in prompts}
    prefill: dict[int, list[float]] = {n: [] for n in prompts}
    for _ in range(args.rounds):
        for n, prompt in prompts.items():
            ms, tok_s = decode_ms(engine, prompt, args.tokens)
            rounds[n].append(ms)
            prefill[n].append(tok_s)
    short, long = statistics.median(rounds[args.short]), statistics.median(rounds[args.long])
    plan = engine.plan
    result = {
        "model": str(model), "size": args.size, "short": args.short, "long": args.long, "tokens": args.tokens, "rounds": args.rounds,
        "decode_ms_per_token": {str(n): statistics.median(v) for n, v in rounds.items()},
        "decode_ms_per_token_rounds": {str(n): v for n, v in rounds.items()},
        "ratio_long_over_short": long / short, "target": TARGET, "meets_target": long / short <= TARGET,
        "prefill_tok_s": {str(n): statistics.median(v) for n, v in prefill.items()},
        "dtype": str(engine.dtype).removeprefix("torch."), "max_context": engine.max_context,
        "plan_kv_bytes": plan.kv_bytes, "plan_kv_bytes_per_1k": plan.kv_bytes_per_1k, "decode": plan.decode,
        "load_s": load_s, "date": time.strftime("%Y-%m-%d"), "commit": commit(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average": os.getloadavg(), "torch": torch.__version__,
    }
    engine.close()
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "linear_attention_decode.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What structured output costs: decode tok/s of N streams at once, without and with a JSON schema.

    python bench/structured_output.py [--model DIR] [--device cpu|cuda] [--streams 8] [--tokens 128] [--repeat 3]
                                      [--out DIR]

Loads `Engine.from_pretrained(DIR)` (no --model: the default demo model) with `planner.max_batch` = N, then runs
`--repeat` rounds of two batches of N greedy requests submitted at once, each decoding exactly `--tokens` tokens:
`plain` (free text, EOS ignored) and `json_schema` (the same prompts under a strict schema of a long array of
objects, which no stream completes within `--tokens`, so all N decode to the end). A batch's decode tok/s is its
tokens after each stream's first, over the wall-clock time from the step that gave every stream its first token to
the last token; the scheduler's own step times (steps with N decode tokens and no prompt) are reported beside it,
and the grammar's own work a step (the mask of the streams' logits rows, one call for all of them as the scheduler
makes it, and their matchers' advance), timed apart from the model.
The cost is 1 - median(json_schema) / median(plain); the
median of each round's own ratio is given too (a round's two batches run back to back, so a drift in the machine's
load between rounds cancels out of it). On CUDA both batches run overlapped decode (the default); a row with a
grammar is sampled only once the host has its last token and has advanced the grammar, while the GPU runs the
next step's forward pass.
Writes structured_output.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# what a tool-using app asks for, long enough that no stream finishes it within --tokens: 64 items of several
# bounded fields each (at least 20 tokens an item)
ITEM = {"type": "object", "properties": {
    "book": {"type": "string", "maxLength": 24},
    "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
    "verse": {"type": "integer", "minimum": 1, "maximum": 176},
    "text": {"type": "string", "maxLength": 160},
    "tags": {"type": "array", "items": {"enum": ["law", "history", "poetry", "prophets", "gospel", "letters"]},
             "maxItems": 3},
    "quoted": {"type": "boolean"}},
    "required": ["book", "chapter", "verse", "text", "tags", "quoted"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                           "verses": {"type": "array", "items": ITEM, "minItems": 64, "maxItems": 64}},
          "required": ["topic", "verses"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verses", "schema": SCHEMA, "strict": True}}
TOPICS = ["mercy", "the sea", "kings", "harvest", "wisdom", "the law", "a journey", "the temple", "light", "bread",
          "the mountain", "rivers", "shepherds", "the gate", "wine", "the stars"]


def run_batch(engine, prompts: list[list[int]], tokens: int, response_format: dict | None) -> dict:
    """Submit one request per prompt at once and time the decode phase (every stream's first token to the last)."""
    from strata.runtime.generation.requests import GenRequest
    from strata.runtime.generation.sampler import SamplingParams

    sched = engine.scheduler()
    reqs = [GenRequest(p, SamplingParams(max_tokens=tokens, ignore_eos=True, response_format=response_format))
            for p in prompts]
    t0 = time.perf_counter()
    handles = sched.submit_together(reqs, asynchronous=False)
    streams = [h.iter_events(timeout=600) for h in handles]
    events = [[next(s)] for s in streams]  # every stream's first token (its prompt's pass)
    t1, wall1 = time.perf_counter(), time.time()
    for evs, s in zip(events, streams, strict=True):
        evs.extend(s)
    t2 = time.perf_counter()
    counts = [sum(1 for e in evs if e.token_id is not None) for evs in events]
    finish = sorted({evs[-1].finish_reason for evs in events})
    steps = [s for s in sched.recent_steps() if s["t"] > wall1 and s["decode"] == len(prompts) and s["prompt"] == 0]
    decode_tokens = sum(counts) - len(prompts)
    return {"tokens": counts, "finish": finish, "ttft_s": t1 - t0, "decode_s": t2 - t1,
            "decode_tok_s": decode_tokens / (t2 - t1),
            "step_tok_s": sum(s["decode"] for s in steps) / sum(s["seconds"] for s in steps) if steps else None,
            "full_steps": len(steps), "text": "".join(e.text for e in events[0])[:200],
            "first_stream": [e.token_id for e in events[0] if e.token_id is not None]}


def grammar_host_us(engine, token_ids: list[int], streams: int) -> dict:
    """A grammar's own work a step, apart from the model: `token_ids` (a json_schema stream's) replayed by `streams`
    fresh matchers at once, timing the scheduler's calls: the mask of their logits rows on the engine's device (one
    `GrammarBatch.mask` over [streams, V]) and each matcher's advance; median and p90, us a step."""
    import torch

    from strata.runtime.generation.grammar import GrammarBatch, ResponseFormat

    grammar = engine.compile_grammar(ResponseFormat.parse(FORMAT))
    matchers, rows = [grammar.matcher() for _ in range(streams)], GrammarBatch()
    logits = torch.randn(streams, engine.checkpoint.config.vocab_size, device=engine.device)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    mask, advance = [], []
    for token in token_ids:
        sync()
        t0 = time.perf_counter()
        rows.mask(logits, matchers)
        sync()
        t1 = time.perf_counter()
        assert all(m.advance(token) for m in matchers)
        advance.append(time.perf_counter() - t1)
        mask.append(t1 - t0)

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"median_us": xs[len(xs) // 2] * 1e6, "p90_us": xs[int(len(xs) * 0.9)] * 1e6}

    return {"tokens": len(token_ids), "streams": streams, "mask": stats(mask), "advance": stats(advance)}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint or store directory (default: the demo model)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="tokens each stream decodes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-context", type=int, default=1024, help="runtime.max_context (the KV cache's rows a slot)")
    p.add_argument("--out", default=None, help="directory for structured_output.json")
    p.add_argument("--commit", default=None, help="the commit measured (default: this checkout's HEAD)")
    args = p.parse_args(argv)

    import torch

    from strata import Engine
    from strata.runtime.generation.grammar import ResponseFormat

    load = {"start": os.getloadavg()}
    engine = Engine.from_pretrained(args.model, device=args.device, config={
        "planner": {"max_batch": args.streams}, "runtime": {"max_context": args.max_context}})
    engine.wait_settled()
    sched = engine.scheduler(max_batch=args.streams)
    sched.start()
    tok = engine.tokenizer
    prompts = [tok.encode(f"Verses about {TOPICS[i % len(TOPICS)]}, as JSON:") for i in range(args.streams)]
    t = time.perf_counter()
    engine.compile_grammar(ResponseFormat.parse(FORMAT))  # first use: xgrammar's import and vocabulary, then the schema
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.compile_grammar(ResponseFormat.parse(FORMAT))
    cached_s = time.perf_counter() - t
    for fmt in (None, FORMAT):  # warm-up: the kernels' first calls, the grammar's first masks
        run_batch(engine, prompts, min(16, args.tokens), fmt)
    runs: dict[str, list[dict]] = {"plain": [], "json_schema": []}
    for i in range(args.repeat):  # alternated (and which goes first too), so a drift in load reaches both alike
        for name in (["plain", "json_schema"] if i % 2 == 0 else ["json_schema", "plain"]):
            runs[name].append(run_batch(engine, prompts, args.tokens, FORMAT if name == "json_schema" else None))
    host = grammar_host_us(engine, runs["json_schema"][0]["first_stream"], args.streams)
    for r in runs["plain"] + runs["json_schema"]:
        del r["first_stream"]
    load["end"] = os.getloadavg()
    for name, rs in runs.items():
        assert all(r["tokens"] == [args.tokens] * args.streams and r["finish"] == ["length"] for r in rs), \
            f"{name}: a stream ended before --tokens: {[(r['tokens'], r['finish']) for r in rs]}"
    median = {k: statistics.median(r["decode_tok_s"] for r in rs) for k, rs in runs.items()}
    median_steps = {k: statistics.median(r["step_tok_s"] for r in rs if r["step_tok_s"]) for k, rs in runs.items()}
    pairs = [s["decode_tok_s"] / p["decode_tok_s"] for p, s in zip(runs["plain"], runs["json_schema"], strict=True)]
    result = {
        "bench": "structured_output", "commit": args.commit or _commit(), "date": time.strftime("%Y-%m-%d"),
        "model": str(engine.source), "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "load_avg": load, "overlap_decode": sched.overlap,
        "streams": args.streams, "tokens": args.tokens, "repeat": args.repeat,
        "compile_first_s": compile_s, "compile_cached_s": cached_s,
        "median_decode_tok_s": median, "median_step_tok_s": median_steps,
        "cost": 1 - median["json_schema"] / median["plain"],
        "cost_steps": 1 - median_steps["json_schema"] / median_steps["plain"],
        "cost_per_round": 1 - statistics.median(pairs), "round_ratios": pairs, "grammar_per_step": host,
        "runs": runs,
    }
    engine.close()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "structured_output.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

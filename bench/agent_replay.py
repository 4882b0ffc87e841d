"""An agent's conversation replayed turn by turn, with the prefix cache and without: prefill tokens computed and the
time to first token of each turn.

    python bench/agent_replay.py [--model DIR] [--turns 20] [--system-tokens 1200] [--user-tokens 150]
        [--answer-tokens 180] [--gpu-fraction F] [--device auto] [--max-context N] [--out DIR]

A coding or tool-using agent resends the whole conversation every turn: a long system prompt (tools, files), then
each user message and the model's answer so far. Here the system prompt is `--system-tokens` tokens of text, each
turn adds a user message of `--user-tokens` and a greedy answer of up to `--answer-tokens` tokens, all rendered by
the checkpoint's chat template (the answers' text goes back through it, as a client sends it), so by the last of
the defaults' 20 turns the prompt is about 8K tokens. Default model: the trained demo model (strata's default).

One engine runs the conversation twice through its scheduler (the one loop the server and `Engine` share), one
request at a time (`planner.max_batch` 1): first with the prefix cache, generating the answers, then every request
with `prefix_cache=False`, replaying the same prompts (the answers of the first run). Per turn: prompt tokens,
tokens served from the cache, prompt tokens the model computed (`Engine.stats()`), the time from submitting to the
first token (TTFT) and to the last. Totals: prefill tokens computed in each run and their ratio, the last turn's
TTFT in each run and their ratio, and how many answers the run without the cache reproduced token for token.
`--gpu-fraction F` sets `tiers.gpu.budget` to that share of the expert bytes (the issue's target: 0.25 on the bench
model). Writes agent_replay.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("and the of that he shall unto his lord they be is him not them it with all thou thy was god which my me "
         "said but ye their have for will land there when upon man out by house come up this from day were people "
         "king son hath before children let also into go even made now then thee should our city hand us saying "
         "file function return value error test build cache prefix token model server request answer").split()


def text_of(tokenizer, tokens: int, seed: int) -> str:
    """Words drawn with a fixed seed until the text is `tokens` tokens long (by the model's tokenizer)."""
    import random

    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) for _ in range(max(8, tokens // 4))]
        text = " ".join(words)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens], skip_special_tokens=True)


def ask(scheduler, ids: list[int], answer_tokens: int, cache: bool) -> dict:
    """One greedy request; its tokens, cached prompt tokens, TTFT and total seconds."""
    from strata.runtime.generation.requests import GenRequest
    from strata.runtime.generation.sampler import SamplingParams

    t0 = time.perf_counter()
    h = scheduler.submit(GenRequest(ids, SamplingParams(max_tokens=answer_tokens, temperature=0.0), prefix_cache=cache),
                         asynchronous=False)
    first, tokens, last = None, [], None
    for ev in h.iter_events(timeout=3600):
        if ev.token_id is not None:
            first = first if first is not None else time.perf_counter() - t0
            tokens.append(ev.token_id)
        if ev.finish_reason is not None:
            if ev.finish_reason == "abort":
                raise RuntimeError(f"a request failed: {ev.error}")
            last = ev
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "cached": last.cached_tokens, "ttft_s": first if first is not None else seconds,
            "seconds": seconds, "finish": last.finish_reason}


def replay(engine, conversation: list[dict], turns: list[str], answers: list[str] | None, answer_tokens: int,
           cache: bool) -> tuple[list[dict], list[str]]:
    """Run every turn; `answers` None: the model's answers join the conversation (and are returned), else these."""
    scheduler = engine.scheduler()
    messages, rows, said = list(conversation), [], []
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        ids = engine.chat_prompt(messages)
        before = engine.stats()["prompt_tokens"]
        r = ask(scheduler, ids, answer_tokens, cache)
        computed = engine.stats()["prompt_tokens"] - before
        text = engine.tokenizer.decode(r["tokens"], skip_special_tokens=True)
        said.append(text)
        messages.append({"role": "assistant", "content": text if answers is None else answers[i]})
        rows.append({"turn": i + 1, "prompt_tokens": len(ids), "cached_tokens": r["cached"], "computed_tokens": computed,
                     "answer_tokens": len(r["tokens"]), "ttft_s": round(r["ttft_s"], 4), "seconds": round(r["seconds"], 4),
                     "tokens": r["tokens"]})
        print(f"{'cache' if cache else 'plain'} turn {i + 1}: prompt {len(ids)}, cached {r['cached']}, computed "
              f"{computed}, ttft {r['ttft_s']:.3f} s", flush=True)
    return rows, said


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint or store directory (default: the trained demo model)")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--user-tokens", type=int, default=150)
    p.add_argument("--answer-tokens", type=int, default=180)
    p.add_argument("--gpu-fraction", type=float, default=None, help="tiers.gpu.budget as a share of the expert bytes")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-context", type=int, default=None, help="default: the conversation's length plus a margin")
    p.add_argument("--debug", default="{}", help="JSON: [debug] settings, e.g. '{\"cuda_graphs\": false}'")
    p.add_argument("--out", default=None, help="directory for agent_replay.json")
    args = p.parse_args(argv)

    import torch

    from bench.provenance import commit
    from strata import Engine
    from strata.runtime.demo.model import ensure_default_model
    from strata.runtime.plan.footprint import read_footprint

    model = Path(args.model) if args.model else ensure_default_model()
    context = args.max_context or args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens + 64) + 256
    cfg: dict = {"runtime": {"max_context": context}, "planner": {"max_batch": 1}, "debug": json.loads(args.debug)}
    if args.gpu_fraction is not None:
        fp = read_footprint(model)
        cfg["tiers"] = {"gpu": {"budget": str(int(fp.total_experts * fp.expert_bytes * args.gpu_fraction))}}
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, config=cfg, device=args.device)
    load_s = time.perf_counter() - t0
    engine.wait_settled()
    engine.scheduler().start()
    tok = engine.tokenizer
    system = {"role": "system", "content": text_of(tok, args.system_tokens, 1)}
    turns = [text_of(tok, args.user_tokens, 100 + i) for i in range(args.turns)]
    ask(engine.scheduler(), engine.chat_prompt([{"role": "user", "content": text_of(tok, 64, 99)}]), 4, False)  # warm-up

    cached, answers = replay(engine, [system], turns, None, args.answer_tokens, cache=True)
    plain, _ = replay(engine, [system], turns, answers, args.answer_tokens, cache=False)
    engine.close()

    same = sum(a["tokens"] == b["tokens"] for a, b in zip(cached, plain, strict=True))
    computed = {"cache": sum(r["computed_tokens"] for r in cached), "plain": sum(r["computed_tokens"] for r in plain)}
    last = {"cache": cached[-1]["ttft_s"], "plain": plain[-1]["ttft_s"]}
    result = {
        "model": str(model), "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "gpu_fraction": args.gpu_fraction, "prefill_chunk": engine.prefill_chunk, "max_context": engine.max_context,
        "turns": args.turns, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
        "answer_tokens": args.answer_tokens, "load_s": round(load_s, 2),
        "prefill_tokens_computed": computed,
        "prefill_tokens_ratio": round(computed["plain"] / computed["cache"], 2) if computed["cache"] else None,
        "last_turn_prompt_tokens": cached[-1]["prompt_tokens"], "last_turn_cached_tokens": cached[-1]["cached_tokens"],
        "last_turn_ttft_s": last,
        "last_turn_ttft_ratio": round(last["plain"] / last["cache"], 2) if last["cache"] else None,
        "answers_identical": f"{same}/{args.turns}",
        "per_turn": {"cache": [{k: v for k, v in r.items() if k != "tokens"} for r in cached],
                     "plain": [{k: v for k, v in r.items() if k != "tokens"} for r in plain]},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "commit": commit(),
        "debug": cfg["debug"], "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_turn"}, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "agent_replay.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

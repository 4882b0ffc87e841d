"""One stream's decode and prefill speed on the CPU through the public API, for comparing commits on one machine.

    python bench/cpu_decode.py --model DIR [--prompt-tokens 64] [--tokens 64] [--repeat 3] [--out DIR]

Loads `Engine.from_pretrained(DIR, device="cpu")` with the default configuration, then runs `--repeat` greedy
generations of `--tokens` tokens after a fixed `--prompt-tokens`-token prompt and reports each run's decode and prefill
tok/s from `Engine.stats()` (the engine's own timers) as JSON. Run it with another checkout first on PYTHONPATH to
measure that commit on the same machine, alternating the two.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint or store directory")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for cpu_decode.json")
    args = p.parse_args(argv)

    import torch

    import strata
    from strata import Engine

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, device="cpu")
    load_s = time.perf_counter() - t0
    vocab = engine.stats().get("vocab_size") or 4096
    prompt = [(7 * i + 3) % min(vocab, 4000) + 3 for i in range(args.prompt_tokens)]
    runs = []
    for _ in range(args.repeat):
        before = engine.stats()
        out = engine.generate(prompt, max_tokens=args.tokens, temperature=0.0, stop_token_ids=[])
        after = engine.stats()
        decode_tokens = after["decode_tokens"] - before["decode_tokens"]
        decode_s = after["decode_seconds"] - before["decode_seconds"]
        runs.append({"tokens": len(out.token_ids), "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0})
    engine.close()
    result = {"model": args.model, "strata": os.path.dirname(strata.__file__), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_s": load_s,
              "runs": runs}
    print(json.dumps(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_decode.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One stream's decode and prefill speed on the CPU through the public API, for comparing commits on one machine.

    python bench/cpu/cpu_decode.py [--model DIR] [--prompt-tokens 64] [--tokens 64] [--repeat 3] [--busy N] [--out DIR]

Loads `Engine.from_pretrained(DIR, device="cpu")` (no --model: the default demo model) with the default configuration,
then runs `--repeat` greedy generations of `--tokens` tokens after a fixed `--prompt-tokens`-token prompt and reports
each run's decode tok/s from `Engine.stats()` (the engine's own timers) as JSON. Run it with another checkout first on
PYTHONPATH to measure that commit on the same machine, alternating the two.

`--busy N`: a busy host. Each round runs one generation alone and one while N other processes keep every core busy at
the same priority (a torch matrix product in a loop on torch's default threads, as a concurrent test run does),
alternating which goes first; the summary gives each condition's median and busy / alone.

`--rows-ab`: each round runs one generation with the decode step's small ops as compiled calls
(strata.kernels.cpu.rows, the default) and one with them off (torch's ops: the model's fused kernels off, as `[debug]
fused_kernels = false`), alternating which goes first, in the one engine (so memory placement and the process are the
same for both); the summary gives each condition's median.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


HOG = "import torch\nx = torch.randn(1024, 1024)\nwhile True:\n    x @ x"  # one busy process: torch's threads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint or store directory (default: the demo model)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, metavar="N", help="also decode beside N CPU-bound processes")
    p.add_argument("--rows-ab", action="store_true", help="alternate the compiled decode rows on and off")
    p.add_argument("--out", default=None, help="directory for cpu_decode.json")
    args = p.parse_args(argv)

    import torch

    import strata
    from strata import Engine

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, device="cpu")
    engine.wait_settled()  # every expert in RAM before timing
    load_s = time.perf_counter() - t0
    vocab = engine.stats().get("vocab_size") or 4096
    prompt = [(7 * i + 3) % min(vocab, 4000) + 3 for i in range(args.prompt_tokens)]
    shipped = engine.model.kernel_options  # [debug] fused_kernels and the rest, as the engine set them

    def run(busy: int, rows_on: bool = True) -> dict:
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(busy)]
        try:
            time.sleep(1.0 if busy else 0.0)  # the hogs' threads running before the generation starts
            engine.model.kernel_options = dataclasses.replace(shipped, fused=shipped.fused and rows_on)
            before = engine.stats()
            out = engine.generate(prompt, max_tokens=args.tokens, temperature=0.0, stop_token_ids=[])
            after = engine.stats()
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        decode_tokens = after["decode_tokens"] - before["decode_tokens"]
        decode_s = after["decode_seconds"] - before["decode_seconds"]
        return {"busy": busy, "rows": rows_on, "tokens": len(out.token_ids),
                "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0, "load_avg": os.getloadavg()[0]}

    engine.generate(prompt, max_tokens=8, temperature=0.0)  # warm-up: kernels built, experts placed
    runs = []
    for i in range(args.repeat):
        if args.rows_ab:
            runs += [run(0, rows_on=on) for on in ((True, False) if i % 2 == 0 else (False, True))]
            continue
        for busy in ((0, args.busy) if i % 2 == 0 else (args.busy, 0)) if args.busy else (0,):
            runs.append(run(busy))
    engine.close()
    from bench import provenance

    result = {"model": args.model, "strata": os.path.dirname(strata.__file__), "commit": provenance.commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load_s": load_s,
              "runs": runs}
    if args.busy:
        alone = statistics.median(r["decode_tok_s"] for r in runs if not r["busy"])
        busy = statistics.median(r["decode_tok_s"] for r in runs if r["busy"])
        result["summary"] = {"alone_tok_s": alone, "busy_tok_s": busy, "busy_over_alone": busy / alone,
                             "busy_processes": args.busy}
    if args.rows_ab:
        on = statistics.median(r["decode_tok_s"] for r in runs if r["rows"])
        off = statistics.median(r["decode_tok_s"] for r in runs if not r["rows"])
        result["summary"] = {"rows_on_tok_s": on, "rows_off_tok_s": off, "on_over_off": on / off}
    print(json.dumps(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_decode.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

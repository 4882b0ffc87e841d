"""A CPU prefill with the calling thread's OpenMP workers alive against freed (`release_openmp_workers`), alternated.

    python bench/cpu/cpu_omp_workers.py --model DIR [--prompt 64 512] [--rounds 3] [--threads 2] [--plain-max 64 12]
                                        [--out DIR]

The engine runs the model on its scheduler's thread. An idle OpenMP team left on another thread (the one that loaded
the engine, or an app's own torch work) counts against the CPUs, and libgomp's teams then sleep at every barrier
instead of spinning: each of torch's parallel ops on the scheduler's thread waits on futex wake-ups. Each round
times one prefill (submission to first token, a fresh prompt of each length, `Engine.generate(max_tokens=1)`) in two
states, alternating which goes first: "alive" after a parallel torch op on this thread made its team again, "freed"
after `release_openmp_workers()`; with `--plain-max`, each state once per value of the hand-off of plain experts to
torch's GEMMs (`experts.plain_max_tokens` replaced: 64 keeps every expert of a 512-token prompt on the kernel, 12 is
the AMX hand-off). Prints the medians and each case against the first; writes cpu_omp_workers.json into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script
from bench.cpu.cpu_experts import machine  # noqa: E402
from bench.cpu.cpu_prompt_layers import handing_off_at  # noqa: E402
from bench.cpu.strata_cpu_side import engine_config  # noqa: E402
from bench.provenance import commit  # noqa: E402
from strata import Engine  # noqa: E402
from strata.kernels.cpu import experts as ce  # noqa: E402
from strata.kernels.cpu.library import release_openmp_workers  # noqa: E402


def prefill_seconds(engine: Engine, tokens: int, gen: torch.Generator) -> float:
    """Seconds to the first token of a fresh `tokens`-token prompt (no prefix-cache hit)."""
    prompt = torch.randint(100, engine.checkpoint.config.vocab_size - 100, (tokens,), generator=gen).tolist()
    t0 = time.perf_counter()
    engine.generate(prompt, max_tokens=1)
    return time.perf_counter() - t0


def set_state(state: str) -> None:
    """This thread's OpenMP workers alive or freed."""
    if state == "alive":
        torch.randn(4_000_000).exp_()  # a parallel op: this thread's team made again
    elif not release_openmp_workers():
        raise SystemExit("this torch's OpenMP runtime cannot free a thread's workers (omp_pause_resource_all)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint or store directory")
    ap.add_argument("--prompt", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain-max", type=int, nargs="*", default=[], help="hand-offs to compare (default: as shipped)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    engine = Engine.from_pretrained(args.model, config=engine_config(args.threads, 1, max(args.prompt) + 64, "auto",
                                                                      False), device="cpu")
    gen = torch.Generator().manual_seed(0)
    prefill_seconds(engine, max(args.prompt), gen)  # the first pass: kernel builds, oneDNN's primitives
    cases = [(state, pm) for pm in (args.plain_max or [None]) for state in ("alive", "freed")]
    names = [state + (f", plain_max={pm}" if pm is not None else "") for state, pm in cases]
    times: dict[int, dict[str, list[float]]] = {n: {name: [] for name in names} for n in args.prompt}
    for r in range(args.rounds):
        order = list(zip(cases, names, strict=True))
        for (state, pm), name in order if r % 2 == 0 else order[::-1]:
            for n in args.prompt:
                set_state(state)
                with handing_off_at(pm):
                    times[n][name].append(prefill_seconds(engine, n, gen))
            print(f"round {r + 1}, {name}: " + ", ".join(f"{n} tokens {times[n][name][-1] * 1e3:.0f} ms"
                                                          for n in args.prompt), flush=True)
    result = {"machine": machine(), "commit": commit(), "model": args.model, "threads": args.threads,
              "torch_gemms_on_amx": ce.torch_gemms_on_amx(), "command": " ".join(sys.argv), "prefill_s": times,
              "median_s": {}}
    for n in args.prompt:
        med = {name: statistics.median(times[n][name]) for name in names}
        result["median_s"][n] = {name: round(v, 4) for name, v in med.items()}
        print(f"{n} tokens: " + ", ".join(f"{name} {v * 1e3:.0f} ms (x{med[names[0]] / v:.2f})"
                                          for name, v in med.items()))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cpu_omp_workers.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

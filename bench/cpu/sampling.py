"""What drawing a sampled token costs on the host: the inverse CDF strata uses for float32 CPU logits against the
exponential race it uses on the GPU, over a vocabulary of the bench model's size.

    python bench/cpu/sampling.py [--vocab 151936] [--rows 1 4] [--repeat 200] [--out DIR]

Each way draws `rows` rows of random logits (standard normal x 3, the spread of a language model's) with one
generator per row, as a decode step of that many streams does (strata.runtime.generation.sampler.sample_rows); the
figure is the median over `--repeat` calls, one thread (a CPU decode's sampling runs on the stepping thread alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cpu.timing import median_seconds  # noqa: E402


def time_call(fn, repeat: int) -> float:
    """Median microseconds of `fn()` over `repeat` calls after one untimed call."""
    return round(median_seconds(fn, repeat) * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from bench.provenance import write_record
    from strata.runtime.generation.sampler import _draw_host, _draw_race, make_generator

    torch.set_num_threads(1)
    results = []
    for n in args.rows:
        logits = torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n)) * 3
        gens = [make_generator(i) for i in range(n)]
        host = time_call(lambda: _draw_host(logits, gens), args.repeat)  # noqa: B023 - called at once
        race = time_call(lambda: _draw_race(logits, gens), max(5, args.repeat // 10))  # noqa: B023
        results.append({"rows": n, "inverse_cdf_us": host, "exponential_race_us": race, "ratio": round(race / host, 1)})
        print(json.dumps(results[-1]), flush=True)
    write_record(args.out, "sampling.json", "cpu/sampling", "bench/cpu/sampling.py", argv, vocab=args.vocab, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A GPU host's tiered prefill with its CPU share's bf16 experts on the CPU kernel against torch's GEMMs, alternated.

    python bench/tools/prefill_hand_off.py --model DIR [--budget BYTES] [--prompt 128 512] [--rounds 3] [--out DIR]

One engine, built as the benchmark suite builds a split case (`runtime.prefill_chunk = 8192`, prefix cache off, a
batch of 8, `--budget` bytes of experts on the GPU: the 12-layer bench model's 25% by default), prefills the suite's
prompt of each length once to warm up, then `--rounds` times in each state, alternating which goes first: "kernel" (as
shipped beside a GPU: `CpuCompute.hands_off` False, the CPU share's experts on the compiled kernel up to its own token
limit) and "hand-off" (`hands_off` True: on a CPU whose AMX tiles torch's GEMMs run on, an expert of more than
`experts.AMX_KERNEL_TOKENS` tokens goes to them, as on a CPU-only host). Seconds a prefill are submission to first
token (`Engine.generate(max_tokens=1)`). Prints the medians and hand-off / kernel; writes prefill_hand_off.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script
from bench.provenance import commit  # noqa: E402
from bench.suite.cases import Workload  # noqa: E402
from bench.suite.strata_case import prompts_for  # noqa: E402
from strata import Engine  # noqa: E402
from strata.kernels.cpu.library import torch_gemms_on_amx  # noqa: E402
from strata.runtime.offload.cpu_compute import CpuCompute  # noqa: E402

STATES = ("kernel", "hand-off")


@contextmanager
def handing_off(on: bool):
    """Inside: the CPU share of every engine hands its bf16 experts of many tokens to torch's GEMMs (`on`) or keeps
    them on the kernel, whatever the host (`CpuCompute.hands_off` replaced)."""
    shipped = CpuCompute.hands_off
    CpuCompute.hands_off = property(lambda self: on)
    try:
        yield
    finally:
        CpuCompute.hands_off = shipped


def prefill_seconds(engine: Engine, prompt: list[int]) -> float:
    """Seconds to the first token of `prompt` (the prefix cache is off: every prefill computes the whole prompt)."""
    t0 = time.perf_counter()
    engine.generate(prompt, max_tokens=1, temperature=0.0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint or store directory")
    ap.add_argument("--budget", type=int, default=3_623_878_656, help="bytes of experts on the GPU")
    ap.add_argument("--prompt", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    config = {"runtime": {"max_context": max(args.prompt) + 80, "prefill_chunk": 8192, "prefix_cache": False},
              "tiers": {"gpu": {"budget": str(args.budget)}}, "planner": {"max_batch": 8}}
    engine = Engine.from_pretrained(args.model, config=config, device="cuda")
    engine.wait_settled()
    vocab = engine.checkpoint.config.vocab_size
    seconds: dict[int, dict[str, list[float]]] = {n: {s: [] for s in STATES} for n in args.prompt}
    try:
        for n in args.prompt:
            prompt = prompts_for(Workload(n, 1, 1), vocab)[0]
            prefill_seconds(engine, prompt)  # warm-up: kernels compiled, the allocator grown
            for r in range(args.rounds):
                for state in (STATES if r % 2 == 0 else STATES[::-1]):
                    with handing_off(state == "hand-off"):
                        seconds[n][state].append(prefill_seconds(engine, prompt))
    finally:
        engine.close()
    rows = {n: {s: statistics.median(v) for s, v in by.items()} for n, by in seconds.items()}
    for n, med in rows.items():
        print(f"{n} tokens: kernel {med['kernel']:.3f} s, hand-off {med['hand-off']:.3f} s "
              f"(hand-off / kernel {med['hand-off'] / med['kernel']:.2f}x)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"commit": commit(), "model": args.model, "config": config, "amx": torch_gemms_on_amx(),
              "gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "seconds": seconds, "median_s": rows}
    (out / "prefill_hand_off.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

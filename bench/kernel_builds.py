"""The builds of the decode step's Triton kernels, counted and timed on any machine, no GPU needed: Triton's binder
gives each launch's specialization key for an H200 (sm_90) target, and each new key is compiled for that target on
this machine's CPU (Triton's wheel carries ptxas). What a fresh install's serving warm-up (strata.runtime.generation.warmup)
spends on them: one decode graph per batch size, each launching the per-layer kernels (the mailbox's pack and fetch,
warm-ahead's plan: the default sweep) once per MoE layer, and the step's other kernels (`--model`).

    python bench/kernel_builds.py [--layers 48] [--max-batch 8] [--top-k 8] [--model [--max-context 4096]]
                                  [--no-compile] [--out DIR]

Triton builds a kernel once per key: its constexprs, each plain int argument's class (1, a multiple of 16, other)
and each pointer's alignment. The probe is strata.runtime.offload.decode_builds (its recorder:
strata.kernels.gpu.builds); bench/jit_probe.py times every build of a real warm-up, on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.kernels.gpu.builds import Unavailable  # noqa: E402
from strata.runtime.offload.decode_builds import BUCKETS, count_builds, describe_builds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--model", action="store_true", help="also the step's other kernels (norms, attention, router, "
                   "expert pairs, combine, GEMV) over the warm-up's batch sizes and KV buckets")
    p.add_argument("--max-context", type=int, default=BUCKETS[-1], help="with --model: the buckets visited")
    p.add_argument("--no-compile", action="store_true", help="count the keys only")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        out = count_builds(a.layers, a.max_batch, a.top_k, a.model, a.max_context, compile=not a.no_compile)
    except Unavailable as e:
        print(f"kernel_builds: error: {e}", file=sys.stderr)
        return 2
    for line in describe_builds(out):
        print(line)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "kernel_builds.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

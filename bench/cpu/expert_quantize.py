"""What quantizing a bf16 expert costs while packing (`strata convert --experts fp8|mxfp4`, `[store] experts`, demo
models): `strata.kernels.quant.quantize_fp8` (128 x 128 blocks) and `quantize_mxfp4` on one expert of the bench model.

    python bench/cpu/expert_quantize.py [--shape 1536 2048] [--threads 1 2] [--repeat 5] [--out DIR]

The matrix is the bench model's gate_up ([2I, H] = [1536, 2048], N(0, 0.02^2) in bf16); each figure is the median of
`--repeat` calls after one untimed call, at each torch thread count. `--against DIR`: also time the quantizers of
another checkout of strata (a `git worktree` of an earlier commit) after this one's at each thread count, and check
that both write the same bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cpu.timing import median_seconds  # noqa: E402


def load_quant(checkout: Path):
    """strata.kernels.quant of another checkout, as a module of its own."""
    spec = importlib.util.spec_from_file_location("other_quant", checkout / "strata" / "kernels" / "quant.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_quant"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def quantize(q, fmt: str, w):
    """`w` quantized by module `q` (strata.kernels.quant, or another checkout's) to `fmt`: (values, scales)."""
    return q.quantize_fp8(w, (128, 128)) if fmt == "fp8" else q.quantize_mxfp4(w)


def median_ms(fn, repeat: int) -> float:
    return round(median_seconds(fn, repeat) * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 2048], metavar=("N", "K"))
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--against", type=Path, default=None, help="another strata checkout to time alongside")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from bench.provenance import write_record
    from strata.kernels import quant

    w = (torch.randn(*args.shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    sides = {"this": quant}
    if args.against is not None:
        sides["against"] = load_quant(args.against)
        for fmt in ("fp8", "mxfp4"):
            pairs = zip(quantize(quant, fmt, w), quantize(sides["against"], fmt, w), strict=True)
            if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs):
                raise SystemExit(f"expert_quantize: {fmt} is written in other bytes than {args.against}'s")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for side, q in sides.items():
            row = {"threads": threads, "side": side,
                   **{f"{fmt}_ms": median_ms(lambda q=q, fmt=fmt: quantize(q, fmt, w), args.repeat)
                      for fmt in ("fp8", "mxfp4")}}
            results.append(row)
            print(json.dumps(row), flush=True)
    write_record(args.out, "expert_quantize.json", "cpu/expert_quantize", "bench/cpu/expert_quantize.py", argv,
                 shape=args.shape, against=str(args.against) if args.against else None, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

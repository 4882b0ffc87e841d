"""What int8 activations would cost in accuracy on GGUF experts: the error of an expert's output when its activations
are rounded as llama.cpp's K-quant dot products round them (Q8_K: int8 against one fp32 scale a 256-value block,
amax / 127), against the bf16 rounding strata's avx512_bf16 kernel applies today, both measured against fp32.

    python bench/cpu/int8_activation_error.py [--trials 200] [--types Q4_K,Q6_K,Q2_K] [--out DIR]

The CPU kernel's GGUF types are compute-bound on few cores because each weight costs one bf16 product
(docs/benchmarks.md, "CPU expert kernel on GGUF experts"); int8 activations (vpdpbusd: 64 products an instruction)
are how llama.cpp avoids that. Whether strata can take them without a numerics mode of their own is what this
measures: per trial, one expert of Qwen3-30B-A3B's shape (H = 2048, I = 768) with random weights quantized to the
type (strata's quantizers, llama.cpp's bytes) and dequantized, one token x ~ N(0, 1) (and, in half of the trials,
Student-t with 3 degrees of freedom: hidden states with outliers); gate and up from x, down from silu(gate) * up, each
matrix's input rounded per scheme (both as llama.cpp does, or only x, or only the intermediate). The bound strata states for a backend is max |out - ref| / max |ref| over a call
(strata.kernels.cpu.numerics): avx512_bf16's is 1.5e-2.

Prints the median and maximum of that ratio per type and scheme as JSON and writes it to --out/int8_activation_error.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.provenance import commit  # noqa: E402

HIDDEN, INTER = 2048, 768  # Qwen3-30B-A3B's expert (H, I)
BF16_BOUND = 1.5e-2  # strata.kernels.cpu.numerics.TOLERANCE["avx512_bf16"]


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 256) rounded as llama.cpp's quantize_row_q8_K_ref does: per 256-value block, the
    value of largest magnitude maps to -127 (iscale = -127 / max), every value to nearest_int(iscale x), at most 127."""
    blocks = x.reshape(-1, 256)
    at = blocks.abs().argmax(dim=1, keepdim=True)
    mx = blocks.gather(1, at)
    iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
    q = torch.round(iscale * blocks).clamp(max=127)
    return (q / torch.where(iscale != 0, iscale, torch.ones_like(iscale))).reshape(x.shape)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


# scheme -> (rounding of x for gate/up, rounding of silu(gate) * up for down)
SCHEMES = {"bf16": (bf16, bf16), "int8 (Q8_K)": (q8_k, q8_k), "int8 x, bf16 intermediate": (q8_k, bf16),
           "bf16 x, int8 intermediate": (bf16, q8_k)}


def expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, rnd=None) -> torch.Tensor:
    rx, rh = rnd or (lambda t: t, lambda t: t)
    xi = rx(x)
    h = F.silu(xi @ gate.T) * (xi @ up.T)
    return rh(h) @ down.T


def quantized(w: np.ndarray, type_name: str) -> torch.Tensor:
    """w quantized to `type_name` and dequantized (the weights a GGUF expert holds), float32."""
    import gguf

    from strata.tiers.store.gguf_quantize import quantize_rows

    blocks = quantize_rows(w, type_name)
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).astype(np.float32))



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--experts", type=int, default=4, help="distinct random experts a type (the trials cycle them)")
    p.add_argument("--types", default="Q4_K,Q6_K,Q2_K")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"bench": "int8_activation_error", "commit": commit(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "command": "python bench/cpu/int8_activation_error.py "
                            + " ".join(argv if argv is not None else sys.argv[1:]),
                 "shape": {"H": HIDDEN, "I": INTER}, "trials": a.trials, "bf16_bound": BF16_BOUND, "types": {}}
    for t in a.types.split(","):
        experts = [tuple(quantized((rng.standard_normal(shape) * 0.02).astype(np.float32), t)
                         for shape in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))) for _ in range(a.experts)]
        ratios: dict[str, list[float]] = {s: [] for s in SCHEMES}
        for k in range(a.trials):
            gate, up, down = experts[k % len(experts)]
            x = torch.randn(1, HIDDEN, generator=gen) if k % 2 == 0 else \
                torch.from_numpy(rng.standard_t(3, (1, HIDDEN)).astype(np.float32))
            ref = expert(x, gate, up, down)
            for s, fn in SCHEMES.items():
                ratios[s].append(float((expert(x, gate, up, down, fn) - ref).abs().max() / ref.abs().max()))
        out["types"][t] = {s: {"median": float(np.median(v)), "p99": float(np.quantile(v, 0.99)), "max": float(max(v)),
                               "over_bf16_bound": int(sum(r > BF16_BOUND for r in v))} for s, v in ratios.items()}
        for s, v in out["types"][t].items():
            print(f"{t} {s}: median {v['median']:.2e}, p99 {v['p99']:.2e}, max {v['max']:.2e}, "
                  f"{v['over_bf16_bound']} of {a.trials} over {BF16_BOUND}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "int8_activation_error.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

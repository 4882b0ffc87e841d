"""llama.cpp's K-quant quantizers, compiled (strata.kernels.cpu.quantize) against their numpy port
(strata.tiers.store.gguf_quantize.quantize_rows_reference): one thread's rate a type, then a whole GGUF export.

    python bench/cpu/gguf_quantize.py [--layers 2] [--experts q4_k_m] [--rounds 3] [--model DIR] [--out DIR]

1. Rate: a Qwen3-30B-A3B expert matrix (768 x 2048, N(0, 0.02^2) in float32) quantized to Q2_K, Q4_K, Q5_K and Q6_K
   on one thread by each implementation, alternating over --rounds rounds; the best round's Mvalues/s a type. Both
   write the same bytes (checked here too).
2. Export: `write_gguf` of the `bench` demo model cut to --layers layers (--model; written there when absent) with its
   routed experts in --experts, once with the compiled quantizers and once with the numpy port (the export's
   `quantize_rows` pointed at it), on the export's own thread pool (every core); seconds, the bf16 expert bytes a
   second, and the two files compared byte for byte.

Prints the figures as JSON and writes them to --out/gguf_quantize.json.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from bench.provenance import commit  # noqa: E402

TYPES = ("Q2_K", "Q4_K", "Q5_K", "Q6_K")



def rates(rounds: int) -> dict[str, dict[str, float]]:
    """Per type: one thread's Mvalues/s, compiled and numpy (best of `rounds` alternating rounds), and their ratio."""
    from strata.kernels.cpu import quantize as compiled
    from strata.tiers.store import gguf_quantize

    x = (np.random.default_rng(0).standard_normal((768, 2048)) * 0.02).astype(np.float32)
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):
        for t in TYPES:
            outs = {}
            for impl, fn in (("compiled", compiled.quantize_rows), ("numpy", gguf_quantize.quantize_rows_reference)):
                t0 = time.perf_counter()
                outs[impl] = fn(x, t)
                dt = time.perf_counter() - t0
                best[(t, impl)] = min(best.get((t, impl), float("inf")), dt)
            if outs["compiled"] is None or not np.array_equal(outs["compiled"], outs["numpy"]):
                raise SystemExit(f"{t}: the compiled quantizer is unavailable or writes other bytes than numpy's")
    out = {}
    for t in TYPES:
        c, n = x.size / best[(t, "compiled")] / 1e6, x.size / best[(t, "numpy")] / 1e6
        out[t] = {"compiled_mvalues_s": round(c, 1), "numpy_mvalues_s": round(n, 1), "ratio": round(c / n, 1)}
        print(f"{t}: compiled {c:.1f} Mvalues/s, numpy {n:.1f} ({c / n:.1f}x), one thread", flush=True)
    return out


def export(model: Path, layers: int, experts: str, out_dir: Path) -> dict:
    """The export's seconds with each implementation, and whether the two files are the same bytes."""
    from strata.tiers.store import gguf_export, gguf_quantize

    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "strata", "demo-model", str(model), "--size", "bench", "--layers",
                        str(layers), "--no-engram"], check=True, stdout=subprocess.DEVNULL)
    checkpoint_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    files, secs = {}, {}
    default = gguf_export.quantize_rows
    try:
        for impl, fn in (("compiled", default), ("numpy", gguf_quantize.quantize_rows_reference)):
            gguf_export.quantize_rows = fn
            files[impl] = out_dir / f"export-{impl}.gguf"
            t0 = time.perf_counter()
            gguf_export.write_gguf(model, files[impl], experts=experts)
            secs[impl] = time.perf_counter() - t0
            print(f"export with the {impl} quantizers: {secs[impl]:.1f} s", flush=True)
    finally:
        gguf_export.quantize_rows = default
    same = filecmp.cmp(files["compiled"], files["numpy"], shallow=False)
    size = files["compiled"].stat().st_size
    for f in files.values():
        f.unlink()
    return {"model": str(model), "layers": layers, "experts": experts, "checkpoint_bytes": checkpoint_bytes,
            "gguf_bytes": size, "threads": min(16, os.cpu_count() or 1),
            "seconds": {k: round(v, 1) for k, v in secs.items()}, "ratio": round(secs["numpy"] / secs["compiled"], 2),
            "same_bytes": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", default="q4_k_m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="the bench demo model cut to --layers (written when absent)")
    p.add_argument("--out", default="bench-out")
    a = p.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Path(a.model or Path.home() / ".cache" / "strata" / "bench" / f"bench-L{a.layers}")
    result = {"bench": "gguf_quantize", "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "load_avg_start": os.getloadavg()[0]},
              "command": "python bench/cpu/gguf_quantize.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rates": rates(a.rounds), "export": export(model, a.layers, a.experts, out_dir)}
    result["machine"]["load_avg_end"] = os.getloadavg()[0]
    (out_dir / "gguf_quantize.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["export"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""strata's bf16 log-probabilities against the fp32 reference, per path, on the tiny gpt-oss and MiniMax-M2 models.

    python bench/bf16_error_probe.py [--device cuda] [--out DIR]

The GPU tests hold strata's bf16 error against the fp32 reference within twice transformers' own bf16 error; on an
H100, gpt-oss and MiniMax-M2 (64 tokens: theta 5,000,000, a rotary of 8 dims of 16) missed it by ~10x while the CPU,
in bf16 through torch's ops or Triton's interpreter, and MiniMax-M2 at 2,100 tokens (theta 10,000, a rotary of 4) do
not. This prints, per model, strata's mean and max error with each `[debug]` switch that changes the CUDA path off in
turn (fused kernels, programmatic dependent launch, grouped prefill), in float32, and on the CPU, with transformers'
own bf16 error beside them, and where along the prompt the error sits. Writes bf16_error_probe.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

VARIANTS = {"default": {}, "no-fused": {"debug": {"fused_kernels": False}}, "no-pdl": {"debug": {"pdl": False}},
            "no-grouped": {"debug": {"grouped_prefill": False}}, "float32": {"runtime": {"dtype": "float32"}}}


def build(name: str, directory: Path):
    """(transformers' fp32 model, checkpoint dir) of the tiny test model `name`."""
    from gpt_oss_models import build_gpt_oss
    from minimax_m2_models import build_minimax_m2_reference

    if name == "gpt_oss":
        return build_gpt_oss(directory, long=False, seed=5)
    return build_minimax_m2_reference(directory, long=name == "minimax_m2_long", seed=5)


def probe(name: str, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from reference_models import VOCAB
    from strata import Engine

    ref32, directory = build(name, Path(tempfile.mkdtemp()) / name)
    prompt = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        exact = torch.log_softmax(ref32(torch.tensor([prompt])).logits[0].float(), -1)
        ref16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
        hf16 = torch.log_softmax(ref16(torch.tensor([prompt], device=device)).logits[0].float(), -1).cpu()
    out = {"transformers_bf16": round((hf16 - exact).abs().mean().item(), 4)}
    for variant, extra in VARIANTS.items():
        cfg = {"runtime": {"max_context": 512, "experts": "memory", "dtype": "bfloat16", **extra.get("runtime", {})}}
        if "debug" in extra:
            cfg["debug"] = extra["debug"]
        with Engine.from_pretrained(directory, config=cfg, device=device) as engine:
            err = (engine.score(prompt) - exact).abs()
        pos = err.mean(-1)
        out[variant] = {"mean": round(err.mean().item(), 4), "max": round(err.max().item(), 3),
                        "first_positions": [round(v, 3) for v in pos[:6].tolist()], "worst_position": int(pos.argmax())}
        print(f"{name} {device} {variant}: {out[variant]} (transformers bf16 {out['transformers_bf16']})", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    result = {name: probe(name, args.device) for name in ("gpt_oss", "minimax_m2", "minimax_m2_long")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bf16_error_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

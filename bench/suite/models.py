"""The suite's checkpoints: two demo models that differ only in routing, written on first use.

- uniform: `--route-skew uniform` (every expert equally likely at every layer: the worst case; plain
  random weights are not uniform, their deeper routers collapse onto a few experts);
- skewed: `--route-skew S` (Zipf-like popularity, S = 1 by default: about 92% of a layer's lookups
  on its 40% most popular experts, the same at every depth; strata.runtime.demo.skew), with
  `--route-locality L` when the suite runs with `--locality L` (temporal locality: each router also weighs the
  last ~19 tokens, L times the token; 0 by default);
Both without Engram layers, so transformers runs exactly the same model. With `--experts fp8` or `mxfp4` both are
written as quantized releases ship them (`strata demo-model --experts`), the same weights rounded to the format.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from bench.suite.roofline import ModelFacts


def demo_model_path(models_dir: Path, size: str, layers: int | None, routing: str, skew: float,
                    locality: float = 0.0, experts: str = "bf16") -> Path:
    tag = "uniform" if routing == "uniform" else f"skew{skew:g}" + (f"-loc{locality:g}" if locality else "")
    return models_dir / (f"{size}-L{layers or 'all'}-{tag}" + (f"-{experts}" if experts != "bf16" else ""))


def ensure_model(models_dir: Path, size: str, layers: int | None, routing: str, skew: float,
                 progress: bool = True, locality: float = 0.0, experts: str = "bf16") -> Path:
    """Write (once) the demo model for `routing` and return its directory (`locality`: the skewed one's
    `--route-locality`; `experts`: its expert format, `strata demo-model --experts`)."""
    from strata.runtime.demo.model import write_demo_model

    locality = 0.0 if routing == "uniform" else locality
    kwargs = {"route_skew": "uniform" if routing == "uniform" else skew}
    if experts != "bf16":
        kwargs["experts"] = experts
    if locality:
        kwargs["route_locality"] = locality
    if "engram" in inspect.signature(write_demo_model).parameters:
        kwargs["engram"] = False  # transformers must run the very same model
    return write_demo_model(demo_model_path(models_dir, size, layers, routing, skew, locality, experts), size, layers,
                            progress=progress, **kwargs)


def routing_of(path: Path) -> tuple[str, str]:
    """(routing label, how it was decided) for a checkpoint given with --model."""
    try:
        marker = json.loads((Path(path) / "strata_demo.json").read_text())
    except (OSError, ValueError):
        return "uniform", "not a strata demo model: its routing is whatever the weights give (labelled uniform)"
    skew = marker.get("route_skew", 0)
    if skew == "uniform":
        return "uniform", "demo model written with --route-skew uniform"
    if skew:
        locality = marker.get("route_locality")
        return "skewed", f"demo model written with --route-skew {skew}" + (
            f" --route-locality {locality}" if locality else "")
    return "uniform", "plain random demo model (--route-skew 0): deeper layers' routing collapses, not truly uniform"


def model_facts(path: Path) -> tuple[ModelFacts, dict]:
    """Roofline facts and a JSON summary (sizes, layers, routing marker) of a checkpoint."""
    from strata.runtime.plan.inspect import summarize_checkpoint

    s = summarize_checkpoint(path)
    role = s.bytes_by_role
    # a step reads every dense weight once, but only one embedding row per token: count the LM head
    # (half the "embeddings" role of an untied model) and not the input table
    dense = sum(v for k, v in role.items() if k not in ("experts", "embeddings", "mtp")) + role["embeddings"] // 2
    facts = ModelFacts(expert_bytes=s.expert_bytes, dense_bytes_per_step=dense, num_experts=s.experts_per_layer,
                       experts_per_token=s.experts_per_token, moe_layers=s.moe_layers)
    try:
        marker = json.loads((Path(path) / "strata_demo.json").read_text())
    except (OSError, ValueError):
        marker = None
    vocab = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    summary = {"path": str(path), "model_type": s.model_type, "layers": s.num_layers, "moe_layers": s.moe_layers,
               "vocab_size": vocab,
               "experts_per_layer": s.experts_per_layer, "experts_per_token": s.experts_per_token,
               "expert_bytes_each": s.expert_bytes, "expert_bytes_total": role["experts"],
               "non_expert_bytes": s.total_bytes - role["experts"], "total_bytes": s.total_bytes, "demo": marker,
               "experts_format": s.expert_format.name if s.expert_format is not None else None}
    return facts, summary

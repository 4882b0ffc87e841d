"""The suite's checkpoints: two demo models that differ only in routing, written on first use.

- uniform: `--route-skew uniform` (every expert equally likely at every layer: the worst case; plain
  random weights are not uniform, their deeper routers collapse onto a few experts);
- skewed: `--route-skew S` (Zipf-like popularity, S = 1 by default: about 92% of a layer's lookups
  on its 40% most popular experts, the same at every depth; strata.runtime.demo.skew), with
  `--route-locality L` when the suite runs with `--locality L` (temporal locality: each router also weighs the
  last ~19 tokens, L times the token; 0 by default);
Both without Engram layers, so transformers runs exactly the same model. With `--experts fp8` or `mxfp4` both are
written as quantized releases ship them (`strata demo-model --experts`), the same weights rounded to the format; with
a GGUF export type (`--experts q4_k_m`, `q2_k`, ...: strata.tiers.store.gguf_mix.EXPORT_TYPES) the bf16 checkpoint is
written, then exported beside it as a GGUF file with its routed experts in that type, and strata runs the file.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from bench.suite.roofline import ModelFacts

GGUF_EXPERTS = ("q8_0", "q6_k", "q5_k", "q4_k", "q4_k_m", "q2_k")  # gguf_mix.EXPORT_TYPES but bf16
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4", *GGUF_EXPERTS)


def demo_model_path(models_dir: Path, size: str, layers: int | None, routing: str, skew: float,
                    locality: float = 0.0, experts: str = "bf16") -> Path:
    tag = "uniform" if routing == "uniform" else f"skew{skew:g}" + (f"-loc{locality:g}" if locality else "")
    name = f"{size}-L{layers or 'all'}-{tag}" + (f"-{experts}" if experts != "bf16" else "")
    return models_dir / (name + ".gguf" if experts in GGUF_EXPERTS else name)


def ensure_model(models_dir: Path, size: str, layers: int | None, routing: str, skew: float,
                 progress: bool = True, locality: float = 0.0, experts: str = "bf16", log=None) -> Path:
    """Write (once) the demo model for `routing` and return its directory (`locality`: the skewed one's
    `--route-locality`; `experts`: its expert format, `strata demo-model --experts`, or a GGUF export type: the
    GGUF file exported from the bf16 checkpoint). `log` is told, with the path, when a model is not on disk yet and
    is being written or exported (minutes for the bench size), so a run's log shows where that time goes."""
    from strata.runtime.demo.model import MARKER, write_demo_model

    say = log or (lambda s: None)
    if experts in GGUF_EXPERTS:
        out = demo_model_path(models_dir, size, layers, routing, skew, locality, experts)
        if not out.exists():  # write_gguf renames a whole file into place: one that exists is complete
            from strata.tiers.store.gguf_export import write_gguf

            source = ensure_model(models_dir, size, layers, routing, skew, progress, locality, log=log)
            say(f"exporting {source} as a GGUF with its routed experts in {experts}: {out} (not on disk yet)")
            write_gguf(source, out, experts=experts)
        return out
    locality = 0.0 if routing == "uniform" else locality
    kwargs = {"route_skew": "uniform" if routing == "uniform" else skew}
    if experts != "bf16":
        kwargs["experts"] = experts
    if locality:
        kwargs["route_locality"] = locality
    if "engram" in inspect.signature(write_demo_model).parameters:
        kwargs["engram"] = False  # transformers must run the very same model
    path = demo_model_path(models_dir, size, layers, routing, skew, locality, experts)
    if not (path / MARKER).is_file():  # the marker is written last: a directory without it is not a whole model
        say(f"writing the {routing} demo model ({size}, {layers or 'all'} layers, {experts} experts): {path} "
            "(not on disk yet)")
    return write_demo_model(path, size, layers, progress=progress, **kwargs)


def gguf_source(path: Path) -> Path:
    """The suite's bf16 checkpoint directory that GGUF file `path` was exported from (`NAME-TYPE.gguf` beside
    `NAME`); the path itself where there is none."""
    stem = path.name.removesuffix(".gguf")
    for export in GGUF_EXPERTS:
        if stem.endswith("-" + export) and (path.parent / stem.removesuffix("-" + export)).is_dir():
            return path.parent / stem.removesuffix("-" + export)
    return path


def routing_of(path: Path) -> tuple[str, str]:
    """(routing label, how it was decided) for a checkpoint given with --model."""
    if path.suffix == ".gguf":
        path = gguf_source(path)
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


def model_facts(path: Path, source: Path | None = None) -> tuple[ModelFacts, dict]:
    """Roofline facts and a JSON summary (sizes, layers, routing marker) of a checkpoint or GGUF file. `source`: the
    bf16 checkpoint directory a GGUF was exported from, whose routing marker and vocabulary the summary takes (by
    default `gguf_source`, which finds it only beside the file, as the suite's --experts exports are)."""
    from strata.runtime.plan.checkpoints.gguf_inspect import summarize_gguf
    from strata.runtime.plan.checkpoints.inspect import summarize_checkpoint

    gguf = Path(path).suffix == ".gguf"
    s = summarize_gguf(path) if gguf else summarize_checkpoint(path)
    if source is None:  # the checkpoint directory a GGUF was exported from
        source = gguf_source(Path(path)) if gguf else Path(path)
    source = Path(source)
    role = s.bytes_by_role
    # a step reads every dense weight once, but only one embedding row per token: count the LM head
    # (half the "embeddings" role of an untied model) and not the input table
    dense = sum(v for k, v in role.items() if k not in ("experts", "embeddings", "mtp")) + role["embeddings"] // 2
    facts = ModelFacts(expert_bytes=s.expert_bytes, dense_bytes_per_step=dense, num_experts=s.experts_per_layer,
                       experts_per_token=s.experts_per_token, moe_layers=s.moe_layers)
    try:
        marker = json.loads((source / "strata_demo.json").read_text())
    except (OSError, ValueError):
        marker = None
    try:
        vocab = json.loads((source / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab = None
    summary = {"path": str(path), "model_type": s.model_type, "layers": s.num_layers, "moe_layers": s.moe_layers,
               "vocab_size": vocab, **({"source": str(source)} if gguf else {}),
               "experts_per_layer": s.experts_per_layer, "experts_per_token": s.experts_per_token,
               "expert_bytes_each": s.expert_bytes, "expert_bytes_total": role["experts"],
               "non_expert_bytes": s.total_bytes - role["experts"], "total_bytes": s.total_bytes, "demo": marker,
               "experts_format": s.expert_format.name if s.expert_format is not None else None,
               "experts_quantized": bool(s.expert_format is not None and s.expert_format.quantized)}
    return facts, summary

"""`strata inspect MODEL`: what a MoE checkpoint holds, from config.json and safetensors headers only.

No weight is read, so a 100+ GB checkpoint is summarised in well under a second. Every tensor is
classified by name into a role (attention, routed experts, router, ...) so the summary shows where the
bytes are: what has to stay resident on the GPU and what can be tiered (the routed experts).

Naming schemes understood (L = layer, E = expert):
  per-expert  `layers.L.mlp.experts.E.{gate,up,down}_proj.*`           Qwen2/3-MoE, DeepSeek-V3
              `layers.L.block_sparse_moe.experts.E.{w1,w2,w3}.*`        Mixtral
  fused       `layers.L.mlp.experts.{gate_up_proj,down_proj}` [E, ...]  transformers 5 native format
  router      `layers.L.{mlp,block_sparse_moe}.gate.*` (incl. DeepSeek's e_score_correction_bias), MiniMax-M2's
              `layers.L.block_sparse_moe.e_score_correction_bias`
  shared      `layers.L.mlp.shared_expert.*`, `shared_expert_gate.*` (Qwen2-MoE), `shared_experts.*` (DeepSeek)
  mtp         DeepSeek-V3's (MiniMax-M2's) multi-token-prediction layers `layers.{num_hidden_layers + i}.*`
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import CheckpointError
from strata.kernels.quant import ExpertFormat
from strata.runtime.model.config import SUPPORTED_ARCHITECTURES
from strata.runtime.model.deepseek_v4.names import renamed_index
from strata.runtime.plan.checkpoints.weight_formats import FP8, FP8_SCALES, MXFP4, experts_format, tensor_format
from strata.runtime.plan.checkpoints.weight_formats import fp8_block as fp8_block_of
from strata.tiers.store.format import is_store, lacks_index, no_index_error, read_index
from strata.tiers.store.safetensors_index import TensorIndex

ROLES = ("attention", "dense_mlp", "experts", "shared_experts", "expert_biases", "router", "embeddings", "norms", "hyper_conns",
         "engram_tables", "engram", "mtp", "other")
# model types whose layouts this module (and strata's loaders) are written against
KNOWN_MODEL_TYPES = SUPPORTED_ARCHITECTURES
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
_MOE_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward", "moe")
_IN_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
RESIDENT_ROLES = tuple(r for r in ROLES if r not in ("experts", "mtp", "engram_tables"))  # "dense": loaded whole


@dataclass
class CheckpointSummary:
    """What `summarize_checkpoint` found; byte counts are tensor data only (headers excluded)."""

    model_type: str
    architecture: str  # config "architectures"[0], "" when absent
    num_layers: int  # decoder layers, MTP layers excluded
    moe_layers: int  # decoder layers with routed experts
    experts_per_layer: int
    experts_per_token: int
    shared_experts: int
    expert_bytes: int  # one routed expert (gate + up + down, with any biases/scales)
    bytes_by_role: dict[str, int]  # every key of ROLES, zero when absent
    total_bytes: int
    dtype: str  # safetensors dtype holding the most bytes, e.g. "BF16"
    expert_layout: str  # "per-expert" | "fused" | "store" (one blob per expert) | "none" (dense model)
    num_files: int
    mtp_layers: int = 0
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # one-line observations: unknown model_type, mismatches
    formats_by_role: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> `tensor_format` -> bytes
    fp8_block: tuple[int, int] | None = None  # config.json's quantization_config.weight_block_size
    expert_format: ExpertFormat | None = None  # the routed experts' (None: no experts, or an unknown dtype)

    def format_name(self, key: str, role: str = "") -> str:
        """A `formats_by_role` key of `role` as `inspect` and `plan` print it: "bf16", "fp8 128x128", "mxfp4"."""
        if role == "experts" and self.expert_format is not None and self.expert_format.quantized \
                and key in (FP8, FP8_SCALES, MXFP4, "U8"):
            return self.expert_format.name  # (a store's blobs: their own block)
        if key.startswith("gguf "):  # a GGUF file's ggml type, or a store's GGUF experts: "gguf Q4_K/Q6_K"
            return key
        if key in (FP8, FP8_SCALES):
            return f"fp8 {self.fp8_block[0]}x{self.fp8_block[1]}" if self.fp8_block else "fp8"
        return key.lower()

    def roles_format(self, roles: tuple[str, ...]) -> tuple[str, int]:
        """(formats, bytes) of `roles` together: "bf16 + fp8 128x128" (most bytes first, scales with their values)."""
        named: dict[str, int] = defaultdict(int)
        for role in roles:
            for key, n in self.formats_by_role.get(role, {}).items():
                named[self.format_name(key, role)] += n
        return " + ".join(sorted(named, key=lambda k: -named[k])), sum(named.values())


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; point strata at a Hugging Face checkpoint directory")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{cfg_file}: not valid JSON ({msg}); re-download it") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: not a JSON object; re-download it")
    return cfg


def _int(cfg: dict, *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _layer_role(rest: str) -> tuple[str, bool]:
    """Role of a tensor inside a decoder layer (`rest` follows "layers.L."), and whether it is a fused
    expert tensor. Per-expert tensors (`experts.E.*`) are matched before this is called."""
    head, _, tail = rest.partition(".")
    if head in ("self_attn", "attention", "attn", "linear_attn"):
        return "attention", False  # includes MLA's q_a/kv_a layernorms, Qwen3's q_norm/k_norm, Qwen3.5's Gated DeltaNet
    if head == "engram":  # the hashed n-gram table is tiered like experts; the rest stays resident
        return ("engram_tables" if tail.startswith("multi_head_embedding.") else "engram"), False
    if head.endswith("norm"):
        return "norms", False  # input_layernorm, post_attention_layernorm, pre/post_feedforward_layernorm
    if head in ("attn_hc", "ffn_hc"):
        return "hyper_conns", False  # DeepSeek-V4's stream mixing around attention and MoE
    if head in _MOE_BLOCKS:
        sub = tail.partition(".")[0]
        if sub == "experts":
            if tail.endswith("_bias"):  # gpt-oss's expert biases: kept dense per layer, not in the experts' records
                return "expert_biases", False
            return "experts", True  # experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I] (or their blocks)
        if sub in ("gate", "router", "e_score_correction_bias"):
            return "router", False
        if sub.startswith("shared_expert"):  # shared_expert, shared_expert_gate, shared_experts
            return "shared_experts", False
        if head == "mlp":
            return "dense_mlp", False
    return "other", False


@dataclass
class _MoeLayer:
    bytes: int = 0
    indices: set[int] = field(default_factory=set)  # per-expert layout
    fused_count: int = 0  # fused layout: leading dim of the 3-D tensors
    fused: bool = False

    @property
    def count(self) -> int:
        return max(self.fused_count, len(self.indices))


@dataclass
class _Tally:
    """Bytes and structure gathered in one pass over the tensor names."""

    by_role: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    by_dtype: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    formats: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))  # (role, format) -> bytes
    layers: set[int] = field(default_factory=set)
    mtp_layers: set[int] = field(default_factory=set)
    moe: dict[int, _MoeLayer] = field(default_factory=lambda: defaultdict(_MoeLayer))
    shared_seen: bool = False
    unknown: list[str] = field(default_factory=list)


def _decoder_prefix(index: TensorIndex) -> str:
    """The prefix decoder layers live under ("model." usually), taken from where embed_tokens is.

    Multimodal checkpoints also have `visual.blocks...`/`vision_tower...layers.N`; those stay "other".
    """
    for name in index.names():
        # skip embed_tokens inside a layer: DeepSeek-V3's MTP layer has its own
        if name.endswith("embed_tokens.weight") and _IN_LAYER.search(name) is None:
            return name[: -len("embed_tokens.weight")]
    return "model."


def _tally(index: TensorIndex, num_layers: int | None) -> _Tally:
    """Classify every tensor by name. Layers at index >= `num_layers` are MTP layers."""
    t = _Tally()
    # one regex that also pulls out the expert index: per-expert tensors are ~99% of a big MoE
    # checkpoint's names, and this fast path keeps 100k names well under a second
    blocks = "|".join(_MOE_BLOCKS)
    prefix = re.escape(_decoder_prefix(index))
    layer_re = re.compile(rf"{prefix}layers\.(\d+)\.(?:(?:{blocks})\.experts\.(\d+)\.)?(.*)")
    by_role, by_dtype, moe, formats = t.by_role, t.by_dtype, t.moe, t.formats
    for info in index:
        name, nbytes = info.name, info.nbytes
        by_dtype[info.dtype] += nbytes
        fmt = tensor_format(info)
        m = layer_re.match(name)
        if m is None:
            if "embed_tokens" in name or name.startswith(("lm_head.", "language_model.lm_head.")):  # (Kimi K2.5)
                role = "embeddings"
            elif ".engram." in name:
                role = "engram"  # model.engram.token_map
            elif name.rpartition(".")[0].endswith("norm"):
                role = "norms"  # model.norm.weight
            elif ".hc_head." in name:
                role = "hyper_conns"  # DeepSeek-V4's final collapse of the streams
            elif name.startswith("mtp."):
                role = "mtp"  # Qwen3.5's multi-token-prediction module, beside the decoder (never loaded)
            else:
                role = "other"
                t.unknown.append(name)
            by_role[role] += nbytes
            formats[role, fmt] += nbytes
            continue
        layer = int(m[1])
        if num_layers is not None and layer >= num_layers:
            t.mtp_layers.add(layer)  # DeepSeek-V3 stores its MTP module as layer num_hidden_layers
            by_role["mtp"] += nbytes
            formats["mtp", fmt] += nbytes
            continue
        t.layers.add(layer)
        if m[2] is not None:  # per-expert: layers.L.mlp.experts.E.*
            st = moe[layer]
            st.bytes += nbytes
            st.indices.add(int(m[2]))
            by_role["experts"] += nbytes
            formats["experts", fmt] += nbytes
            continue
        role, fused = _layer_role(m[3])
        if fused:
            st = moe[layer]
            st.bytes += nbytes
            st.fused = True
            if len(info.shape) == 3:
                st.fused_count = max(st.fused_count, info.shape[0])
        elif role == "shared_experts":
            t.shared_seen = True
        elif role == "other":
            t.unknown.append(name)
        by_role[role] += nbytes
        formats[role, fmt] += nbytes
    return t


def summarize_checkpoint(path: str | Path) -> CheckpointSummary:
    """Summarise the checkpoint directory `path` from config.json and safetensors headers only (a GGUF file:
    strata.runtime.plan.checkpoints.gguf_inspect)."""
    path = Path(path)
    if lacks_index(path):  # a store's files without its index: neither a store nor a checkpoint
        raise no_index_error(path)
    cfg = _read_config(path)
    # multimodal configs keep the language model's numbers under text_config
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    index = TensorIndex.from_dir(path)
    if cfg.get("model_type") == "deepseek_v4":  # the original release's names, as strata reads them
        index = renamed_index(index)
    notes: list[str] = []

    model_type = str(cfg.get("model_type", ""))
    archs = cfg.get("architectures")
    architecture = str(archs[0]) if isinstance(archs, list) and archs else ""
    if model_type not in KNOWN_MODEL_TYPES:
        notes.append(
            f"model_type {model_type or '(none)'!r} is not one strata serves yet "
            f"({', '.join(KNOWN_MODEL_TYPES)}); roles are guessed from tensor names"
        )
    cfg_layers = _int(text, "num_hidden_layers", "n_layers", "num_layers")
    cfg_mtp = (_int(text, "num_nextn_predict_layers", "num_mtp_layers")
               or (_int(text, "num_mtp_modules") or 0) * (_int(text, "mtp_transformer_layers") or 1))  # (MiniMax-M2)
    t = _tally(index, cfg_layers)
    total_bytes, num_files = index.total_bytes(), len(index.files())
    if is_store(path):  # a store: the dense tensors above, the experts and tables from its index
        total_bytes, num_files = _add_store_objects(t, path, total_bytes)

    num_layers = cfg_layers if cfg_layers is not None else (max(t.layers) + 1 if t.layers else 0)
    if cfg_layers is None:
        notes.append(f"config.json has no num_hidden_layers; counted {num_layers} layers from tensor names")
    elif len(t.layers) != cfg_layers:
        notes.append(f"config.json says {cfg_layers} layers but the tensors cover {len(t.layers)}")
    if len(t.mtp_layers) > cfg_mtp:
        notes.append(
            f"tensors of {len(t.mtp_layers)} layers past num_hidden_layers={num_layers} counted as 'mtp', "
            f"but config.json declares {cfg_mtp} MTP layers"
        )
    if t.unknown:
        notes.append(f"{len(t.unknown)} tensors of unrecognised role counted as 'other' (e.g. {t.unknown[0]!r})")

    # experts: the config's count, cross-checked against every MoE layer's tensors
    counts = {st.count for st in t.moe.values()}
    cfg_experts = _int(text, *_EXPERT_COUNT_KEYS)
    experts_per_layer = cfg_experts if cfg_experts is not None else max(counts, default=0)
    if t.moe and counts != {experts_per_layer}:
        found = ", ".join(str(c) for c in sorted(counts))
        notes.append(f"config.json says {experts_per_layer} experts per layer but the tensors hold {found}")
    elif not t.moe and experts_per_layer:
        notes.append(f"config.json says {experts_per_layer} experts per layer but no expert tensors were found")
    first = t.moe[min(t.moe)] if t.moe else None
    expert_bytes = first.bytes // first.count if first is not None and first.count else 0

    layouts = {"store" if is_store(path) else "fused" if st.fused else "per-expert" for st in t.moe.values()}
    expert_layout = layouts.pop() if len(layouts) == 1 else ("none" if not layouts else "mixed")
    if expert_layout == "mixed":
        notes.append("some layers store experts fused and others per expert")

    cfg_shared = _int(text, "n_shared_experts", "num_shared_experts")
    if cfg_shared is None and (_int(text, "shared_expert_intermediate_size") or 0) > 0:
        cfg_shared = 1  # Qwen2-MoE: one shared expert of shared_expert_intermediate_size
    shared_experts = (cfg_shared or 1) if t.shared_seen else 0
    if not t.shared_seen and cfg_shared:
        notes.append(f"config.json says {cfg_shared} shared experts but no shared-expert tensors were found")

    dtype = max(t.by_dtype, key=lambda d: t.by_dtype[d]) if t.by_dtype else ""
    formats_by_role: dict[str, dict[str, int]] = defaultdict(dict)
    for (role, key), n in t.formats.items():
        formats_by_role[role][key] = n
    fp8_block = fp8_block_of(cfg)
    if is_store(path):
        expert_format = read_index(path).expert_format
    else:
        expert_format = experts_format(formats_by_role.get("experts", {}), fp8_block)
    return CheckpointSummary(
        model_type=model_type,
        architecture=architecture,
        num_layers=num_layers,
        moe_layers=len(t.moe),
        experts_per_layer=experts_per_layer,
        experts_per_token=_int(text, "num_experts_per_tok", "experts_per_token", "moe_top_k") or 0,
        shared_experts=shared_experts,
        expert_bytes=expert_bytes,
        bytes_by_role=t.by_role,
        total_bytes=total_bytes,
        dtype=dtype,
        expert_layout=expert_layout,
        num_files=num_files,
        mtp_layers=len(t.mtp_layers),
        bytes_by_dtype=dict(t.by_dtype),
        notes=notes,
        formats_by_role=dict(formats_by_role),
        fp8_block=fp8_block,
        expert_format=expert_format,
    )


def _add_store_objects(t: _Tally, path: Path, dense_bytes: int) -> tuple[int, int]:
    """Count a store's expert blobs and Engram tables (its index lists them; dense.safetensors holds the rest) into
    `t`; returns the summary's total bytes and file count."""
    idx = read_index(path)
    for layer in idx.moe_layers:
        st = t.moe[layer]
        st.fused, st.fused_count, st.bytes = True, idx.num_experts, idx.num_experts * idx.payload_bytes
        t.layers.add(layer)
    experts = len(idx.moe_layers) * idx.num_experts * idx.payload_bytes
    tables = sum(table.nbytes for table in idx.tables.values())
    t.by_role["experts"] += experts
    t.by_role["engram_tables"] += tables
    t.by_dtype[idx.dtype] += experts
    fmt = idx.expert_format
    key = idx.dtype if not fmt.quantized else FP8 if fmt.kind == "fp8" else MXFP4 if fmt.kind == "mxfp4" else fmt.name
    t.formats["experts", key] += experts
    for table in idx.tables.values():
        t.formats["engram_tables", table.dtype] += table.nbytes
    return dense_bytes + experts + tables, len(idx.file_sizes())


def format_bytes(n: int) -> str:
    """`n` bytes as a short human string: GiB, MiB, KiB or bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def formats_line(s: CheckpointSummary) -> str:
    """The routed experts' format and bytes, then the resident weights': "experts fp8 128x128: 600.00 GiB, dense
    bf16 + fp8 128x128: 12.00 GiB"."""
    parts = []
    for what, roles in (("experts", ("experts",)), ("dense", RESIDENT_ROLES)):
        name, n = s.roles_format(roles)
        if n:
            parts.append(f"{what} {name}: {format_bytes(n)}")
    return ", ".join(parts)


def format_summary(s: CheckpointSummary) -> str:
    """A human-readable, multi-line report of `s` for the terminal."""
    name = s.architecture or s.model_type or "unknown architecture"
    lines = [f"{name} ({s.model_type or 'no model_type'})"]
    lines.append(f"  files          {s.num_files}, {format_bytes(s.total_bytes)}, mostly {s.dtype}")
    mtp = f", +{s.mtp_layers} MTP" if s.mtp_layers else ""
    lines.append(f"  layers         {s.num_layers} ({s.moe_layers} MoE, {s.num_layers - s.moe_layers} dense{mtp})")
    if s.moe_layers:
        lines.append(
            f"  experts        {s.experts_per_layer} per layer, {s.experts_per_token} active per token, "
            f"{s.shared_experts} shared; {s.expert_layout} layout"
        )
        lines.append(f"  one expert     {format_bytes(s.expert_bytes)}")
        # what one token touches: every non-routed weight (MTP aside: it only drafts) plus top-k experts per layer
        resident = s.total_bytes - s.bytes_by_role["experts"] - s.bytes_by_role["mtp"]
        active = resident + s.moe_layers * s.experts_per_token * s.expert_bytes
        lines.append(
            f"  per token      {format_bytes(active)} "
            f"(non-expert weights + {s.experts_per_token} experts in each MoE layer)"
        )
    lines.append(f"  formats        {formats_line(s)}")
    lines.append("  bytes by role")
    for role, n in sorted(s.bytes_by_role.items(), key=lambda kv: -kv[1]):
        if n:
            pct = 100 * n / s.total_bytes if s.total_bytes else 0.0
            lines.append(f"    {role:<15}{format_bytes(n):>12}  {pct:5.1f}%  {s.roles_format((role,))[0]}")
    lines += [f"  note: {note}" for note in s.notes]
    return "\n".join(lines)

"""`strata inspect` and `strata plan` on a GGUF file: its summary and footprint from the metadata and tensor infos alone.

GGUF names (llama.cpp's): `blk.L.ffn_{gate,up,down}_exps` routed experts (stacked [E, ...]), `*_shexp` shared experts,
`ffn_gate_inp` the router, `attn_*` attention, `*norm*` norms, `token_embd` / `output` embeddings. Formats are the
file's ggml type names ("gguf Q4_K"); the routed experts' are listed per tensor kind ("gguf Q4_K/Q6_K"), as the store
keeps them. A store of the file dequantizes everything else to float32, which the footprint counts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from strata.runtime.plan.checkpoints.inspect import ROLES, CheckpointSummary
from strata.tiers.store.gguf_reader import PLAIN_TYPES, GGUFFile, split_parts

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def tensor_role(name: str) -> str:
    """The `inspect` role of GGUF tensor `name`."""
    m = _BLOCK.match(name)
    if m is None:
        return "norms" if "norm" in name else "embeddings" if name.split(".")[0] in ("token_embd", "output") else "other"
    rest = m.group(2)
    if "norm" in rest:
        return "norms"
    if rest.startswith("attn_"):
        return "attention"
    if "_exps" in rest:
        return "experts"
    if "_shexp" in rest:
        return "shared_experts"
    if rest.startswith(("ffn_gate_inp", "exp_probs_b")):
        return "router"
    if rest.startswith(("ffn_gate", "ffn_up", "ffn_down")):
        return "dense_mlp"
    return "other"


def summarize_gguf(path: str | Path) -> CheckpointSummary:
    """Summarise a GGUF file (or all parts of a split one) without reading a weight."""
    f = GGUFFile.open(path)
    cfg = f.hf_config
    by_role = dict.fromkeys(ROLES, 0)
    by_dtype: dict[str, int] = defaultdict(int)
    formats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    moe_layers: set[int] = set()
    shared = False
    for name, t in f.tensors.items():
        role, n, kind = tensor_role(name), int(t.n_bytes), t.tensor_type.name
        by_role[role] += n
        by_dtype[kind] += n
        formats[role][kind if kind in PLAIN_TYPES else f"gguf {kind}"] += n
        if role == "experts":
            moe_layers.add(int(_BLOCK.match(name).group(1)))
        shared |= role == "shared_experts"
    num_experts = int(f.field("expert_count"))
    expert_format = None
    if moe_layers:
        from strata.runtime.plan.checkpoints.gguf_convert import expert_format as store_format

        expert_format = store_format(f)
        if expert_format.kind == "gguf":  # one key: the types of gate, up and down as the store keeps them
            formats["experts"] = {expert_format.name: by_role["experts"]}
    return CheckpointSummary(
        model_type=str(cfg["model_type"]), architecture=f"GGUF {f.arch}", num_layers=int(cfg["num_hidden_layers"]),
        moe_layers=len(moe_layers), experts_per_layer=num_experts,
        experts_per_token=int(f.field("expert_used_count")),
        shared_experts=(int(cfg.get("n_shared_experts") or 1) if shared else 0),
        expert_bytes=by_role["experts"] // max(1, len(moe_layers) * num_experts), bytes_by_role=by_role,
        total_bytes=sum(by_role.values()), dtype=max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "",
        expert_layout="fused", num_files=len(split_parts(Path(path).expanduser())), bytes_by_dtype=dict(by_dtype),
        formats_by_role={role: dict(v) for role, v in formats.items()}, expert_format=expert_format,
    )  # fmt: skip

"""The trainable form of the `demo` model: transformers' DeepseekV3ForCausalLM plus strata's Engram layers.

A dev tool (transformers is a dev dependency), used by strata.runtime.demo.train to train the model and by
the tests to check strata against it. The MoE transformer is transformers' own DeepSeek-V3 (MLA attention,
sigmoid group-limited routing with `e_score_correction_bias`, a shared expert), so its semantics are the
ones strata is tested against. Each Engram layer is a `SequenceEngram`: strata's `EngramLayer` (the same
submodules, hence the same checkpoint names) computed over whole sequences [B, T] with a causal dilated
convolution, as DeepSeek's reference demo does; it is attached to transformers' decoder layer as
`engram` and added to the layer's input before its attention, as strata's `DecoderLayer` does.

    model.layers.L.engram.*        the Engram layer of decoder layer L (strata.runtime.demo.engram lists them)
    model.engram.token_map         the tokenizer's ids through Engram's normaliser (F32 holding integers)

`export_checkpoint` writes what strata and transformers load: bf16 safetensors with one tensor per expert
projection (transformers keeps them fused as gate_up_proj [E, 2I, H] and down_proj [E, H, I]).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from strata.runtime.demo.weights import tensor_specs
from strata.runtime.model.engram.hashing import EngramConfig, NgramHasher
from strata.runtime.model.engram.layer import EngramLayer

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class SequenceEngram(EngramLayer):
    """An Engram layer over whole sequences: `forward(x [B, T, H], rows [B, T, heads]) -> [B, T, H]`."""

    def __init__(self, cfg: EngramConfig, hidden: int, layer: int):
        super().__init__(cfg, hidden, layer)
        self.dilation = cfg.max_ngram_size
        # The table starts N(0, 1) (nn.Embedding's default, as in DeepSeek's demo); the projections small and the
        # convolution zero, so the layer starts as a small gated lookup added to the residual stream.
        for proj in (self.key_proj, self.value_proj):
            nn.init.normal_(proj.weight, std=0.02)
            nn.init.zeros_(proj.bias)
        nn.init.zeros_(self.short_conv.conv.weight)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        e = self.multi_head_embedding.embedding(rows).flatten(2).to(x.dtype)  # [B, T, heads * head_dim]
        key, query = self.norm1(self.key_proj(e)), self.norm2(x)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)  # [B, T, 1]
        gate = torch.sigmoid(gate.abs().clamp_min(1e-6).sqrt() * gate.sign())
        value = gate * self.value_proj(e)  # [B, T, H]
        w = self.short_conv.conv.weight  # [H, 1, kernel]: tap i reads position t - (kernel-1-i) * dilation
        pad = (w.shape[-1] - 1) * self.dilation
        conv = F.conv1d(self.short_conv.norm(value).transpose(1, 2), w, padding=pad, dilation=self.dilation,
                        groups=self.hidden)[..., : x.shape[1]]  # causal: the right padding's outputs dropped
        return value + F.silu(conv.transpose(1, 2))


class DemoLM(nn.Module):
    """`forward(ids [B, T]) -> logits [B, T, vocab]` fp32; `self.lm` is transformers' DeepseekV3ForCausalLM with
    the Engram layers inside it, so `self.lm.state_dict()` carries the checkpoint's names."""

    def __init__(self, config: dict, token_map: torch.Tensor):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = {k: v for k, v in config.items() if k != "engram"}
        hf_config = AutoConfig.for_model(**hf, pad_token_id=None)  # a pad id would freeze that embedding row
        hf_config._attn_implementation = "sdpa"
        self.lm = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        self.engram_cfg = EngramConfig(**config["engram"])
        layers = self.lm.model.layers
        for i in self.engram_cfg.layer_ids:
            layers[i].engram = SequenceEngram(self.engram_cfg, config["hidden_size"], i)
            layers[i].register_forward_pre_hook(self._add_engram, with_kwargs=True)
        self.lm.model.engram = nn.Module()
        self.lm.model.engram.register_buffer("token_map", token_map.to(torch.int64).clone())
        self.hasher = NgramHasher(self.engram_cfg, token_map)
        self._rows: dict[int, torch.Tensor] = {}  # layer -> [B, T, heads] row ids of the current forward

    def _add_engram(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs.pop("hidden_states")
        x = x + layer.engram(x, self._rows[layer.engram.layer])
        return (x, *args[1:]), kwargs

    def engram_rows(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every Engram layer's row ids [B, T, heads] for sequences `ids` [B, T] that start at position 0."""
        empty = torch.empty(0, dtype=torch.int64)
        grams = torch.stack([self.hasher.grams(seq, empty) for seq in ids])  # [B, T, max_ngram_size]
        flat = grams.flatten(0, 1)
        return {layer: self.hasher.rows(layer, flat).view(*ids.shape, -1) for layer in self.engram_cfg.layer_ids}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._rows = self.engram_rows(ids)
        try:
            return self.lm(input_ids=ids, use_cache=False).logits.float()
        finally:
            self._rows = {}

    def routers(self) -> dict[int, nn.Module]:
        """MoE layer -> its router (transformers' DeepseekV3TopkRouter: `weight`, `e_score_correction_bias`)."""
        return {i: layer.mlp.gate for i, layer in enumerate(self.lm.model.layers) if hasattr(layer.mlp, "gate")}


def checkpoint_tensors(model: DemoLM, config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (demo_weights.tensor_specs' names, shapes and dtypes) from `model`."""
    state = model.lm.state_dict()
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    inter = config["moe_intermediate_size"]
    out, used = {}, set()
    for spec in tensor_specs(config):
        m = _EXPERT.fullmatch(spec.name)
        if m is None:
            t = state[spec.name]
            used.add(spec.name)
        elif m[3] == "down":
            t = state[f"{m[1]}.down_proj"][int(m[2])]  # [H, I]
            used.add(f"{m[1]}.down_proj")
        else:
            gate_up = state[f"{m[1]}.gate_up_proj"][int(m[2])]  # [2I, H]: gate rows, then up rows
            t = gate_up[:inter] if m[3] == "gate" else gate_up[inter:]
            used.add(f"{m[1]}.gate_up_proj")
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: the model has {tuple(t.shape)}, the checkpoint wants {spec.shape}")
        out[spec.name] = t.detach().to(dtypes[spec.dtype]).contiguous()
    if set(state) - used:
        raise ValueError(f"model tensors the checkpoint would drop: {sorted(set(state) - used)}")
    return out


def export_checkpoint(model: DemoLM, config: dict, path: Path) -> None:
    """Write `model` as one bf16 safetensors file (router biases and token_map F32), byte for byte the same for the
    same weights: tensors in checkpoint order, the F32 ones first (8-byte aligned after the padded header), and a
    header whose metadata carries a hash of the weights, so a retrained model never reuses a store built from
    another (stores are keyed by headers)."""
    tensors = checkpoint_tensors(model, config)
    order = sorted(tensors, key=lambda n: tensors[n].dtype != torch.float32)  # stable: checkpoint order otherwise
    data = {name: tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes() for name in order}
    digest = hashlib.sha256()
    for name in sorted(data):
        digest.update(name.encode() + data[name])
    names = {torch.bfloat16: "BF16", torch.float32: "F32"}
    header: dict[str, dict] = {"__metadata__": {"format": "pt", "strata_demo_weights": digest.hexdigest()[:16]}}
    at = 0
    for name in order:
        header[name] = {"dtype": names[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [at, at + len(data[name])]}
        at += len(data[name])
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in order:
            f.write(data[name])


def load_checkpoint(directory: Path) -> DemoLM:
    """The DemoLM of a checkpoint written by `export_checkpoint` (fp32, eval mode): strata's reference in tests."""
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    model = DemoLM(config, tensors["model.engram.token_map"].to(torch.int64))
    state = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            state[name] = t.float() if name != "model.engram.token_map" else t.to(torch.int64)
        else:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t.float()
    for prefix, per in experts.items():
        order = sorted(per)
        state[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate"], per[e]["up"]]) for e in order])
        state[f"{prefix}.down_proj"] = torch.stack([per[e]["down"] for e in order])
    model.lm.load_state_dict(state, strict=True)
    return model.eval()

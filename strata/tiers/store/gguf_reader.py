"""GGUF files (llama.cpp's format) read with the `gguf` package: metadata mapped to a Hugging Face config, tensors
under transformers' names, routed experts as the file's ggml blocks.

    f = GGUFFile.open("model-00001-of-00003.gguf")   # a split file's other parts are found beside it
    f.hf_config                                       # config.json's keys for strata.runtime.model.config
    for name, w in f.dense_tensors(): ...             # transformers name, tensor (bf16 as stored, else float32)
    gate, up, down = f.experts(layer)                 # (type name, uint8 blocks [E, rows, row_bytes]) each

Architectures: qwen3moe, qwen2moe, deepseek2 (DeepSeek-V2/V3, MLA's `attn_kv_b` or its split `attn_k_b` /
`attn_v_b` as llama.cpp writes them), and llama with `ffn_*_exps` (Mixtral; its q/k rows un-permuted back to
transformers' rotary layout).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from strata.errors import CheckpointError, UnsupportedError
from strata.kernels.gguf_blocks import BLOCK_TYPES, block_type

ARCHES = ("qwen3moe", "qwen2moe", "deepseek2", "llama")
PLAIN_TYPES = ("F32", "F16", "BF16")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# per-layer GGUF tensor -> transformers name under model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}  # fmt: skip
_SHARED = {"qwen2moe": "mlp.shared_expert", "deepseek2": "mlp.shared_experts"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
EXPERT_PROJS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise UnsupportedError("reading GGUF files needs the gguf package; install it with `pip install gguf`") from e
    return gguf


def split_parts(path: Path) -> list[Path]:
    """The files of a GGUF model: `path` alone, or every `-0000k-of-0000N.gguf` part beside it, in order."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF part {missing[0]} is missing; put all {count} parts side by side")
    return parts


class GGUFFile:
    """An opened GGUF model (one file or all parts of a split one): metadata and tensors, nothing dequantized yet."""

    def __init__(self, path: Path, fields: dict, tensors: dict):
        self.path = path
        self.fields = fields  # key -> python value
        self.tensors = tensors  # GGUF name -> gguf ReaderTensor
        self.arch = str(fields.get("general.architecture", ""))
        if self.arch not in ARCHES:
            raise UnsupportedError(f"{path}: GGUF architecture {self.arch!r} is not one strata runs "
                                   f"({', '.join(ARCHES)}); use a model of one of those")
        if self.arch == "llama" and f"{self.arch}.expert_count" not in fields:
            raise UnsupportedError(f"{path}: a llama GGUF without experts is not a MoE model; strata runs MoE models")
        self.hf_config = _hf_config(self)

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        """Open a .gguf file (a split file's first part or any part); one-line `CheckpointError` when it is not whole."""
        gguf = _gguf()
        path = Path(path).expanduser()
        if not path.is_file():
            raise CheckpointError(f"{path}: no such GGUF file")
        fields: dict = {}
        tensors: dict = {}
        for part in split_parts(path):
            try:
                reader = gguf.GGUFReader(part)
            except (ValueError, OSError, IndexError, KeyError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise CheckpointError(f"{part}: not a complete GGUF file ({msg}); re-download or re-export it") from None
            for key, f in reader.fields.items():
                if key not in fields:
                    fields[key] = f.contents()
            for t in reader.tensors:
                tensors[t.name] = t
        return cls(path, fields, tensors)

    def field(self, key: str, default=None):
        """Metadata `ARCH.key` (or a full key) with a default."""
        return self.fields.get(f"{self.arch}.{key}", self.fields.get(key, default))

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing; the file is incomplete")
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        """A tensor in transformers' (row-major, numpy) shape: a BF16 one as it is, any other dequantized to float32
        (exact: K-quant values do not all fit bf16)."""
        gguf = _gguf()
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError:
            raise UnsupportedError(f"{self.path}: tensor {name!r} is GGML type {t.tensor_type.name}, which the gguf "
                                   "package cannot dequantize; requantize it to a K-quant") from None
        if w.size != int(np.prod(shape)):
            raise CheckpointError(f"{self.path}: tensor {name!r} holds {w.size} values, not {list(shape)}; the file is "
                                  "corrupt: re-download or re-export it")
        out = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(shape)  # a copy: the file is mapped read-only
        return out.to(torch.bfloat16) if t.tensor_type.name == "BF16" else out

    def dense_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, tensor: `read`'s dtype) of every tensor but the routed experts, in file order."""
        cfg = self.hf_config
        for name in self.tensors:
            if name in _GLOBAL_NAMES:
                yield _GLOBAL_NAMES[name], self.read(name)
                continue
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
            if m is None:
                raise UnsupportedError(f"{self.path}: tensor {name!r} has no transformers name strata knows")
            layer, base, kind = int(m[1]), m[2], m[3]
            if base in EXPERT_PROJS or base == "attn_v_b" or (base == "attn_kv_b" and self._split_kv_b(layer)):
                continue
            prefix = f"model.layers.{layer}."
            if base == "attn_k_b":
                yield prefix + "self_attn.kv_b_proj.weight", self._kv_b(layer)
                continue
            if base.endswith("_shexp") and base != "ffn_gate_inp_shexp":
                hf = f"{_SHARED[self.arch]}.{base[: -len('_shexp')].replace('ffn_', '')}_proj"
            elif base in _LAYER_NAMES:
                hf = _LAYER_NAMES[base]
            else:
                raise UnsupportedError(f"{self.path}: tensor {name!r} has no transformers name strata knows")
            w = self.read(name)
            if base == "exp_probs_b":
                kind = ""
                hf = hf.rsplit(".", 1)[0] + ".e_score_correction_bias"
            if self.arch == "llama" and base in ("attn_q", "attn_k") and kind == "weight":
                heads = cfg["num_attention_heads"] if base == "attn_q" else cfg["num_key_value_heads"]
                w = _unpermute(w, heads)
            yield prefix + hf + (f".{kind}" if kind else ""), w

    def _split_kv_b(self, layer: int) -> bool:
        return f"blk.{layer}.attn_k_b.weight" in self.tensors

    def _kv_b(self, layer: int) -> torch.Tensor:
        """kv_b_proj [heads * (nope + v), rank] from llama.cpp's split k_b [heads, rank, nope] and v_b [heads, v, rank]."""
        k_b = self.read(f"blk.{layer}.attn_k_b.weight")
        v_b = self.read(f"blk.{layer}.attn_v_b.weight")
        heads = self.hf_config["num_attention_heads"]
        k_b, v_b = k_b.reshape(heads, -1, k_b.shape[-1]), v_b.reshape(heads, -1, v_b.shape[-1])
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, v_b.shape[-1]).contiguous()

    def expert_types(self, layer: int) -> tuple[str, str, str]:
        """The ggml type names of a layer's gate, up and down experts (one-line error for a type strata cannot keep)."""
        out = []
        for proj in EXPERT_PROJS:
            name = f"blk.{layer}.{proj}.weight"
            t = self._tensor(name)
            type_name = t.tensor_type.name
            if type_name not in PLAIN_TYPES:
                block_type(type_name, name)
            out.append(type_name)
        return tuple(out)  # type: ignore[return-value]

    def experts(self, layer: int) -> list[tuple[str, np.ndarray]]:
        """[(type name, data)] for gate, up and down: uint8 blocks [E, rows, row_bytes] (or float [E, rows, K] for a
        plain type), checked against the config's shapes."""
        cfg = self.hf_config
        e, h, i = _num_experts(cfg), cfg["hidden_size"], cfg["moe_intermediate_size"]
        out = []
        for proj, type_name, (rows, k) in zip(EXPERT_PROJS, self.expert_types(layer), ((i, h), (i, h), (h, i)),
                                              strict=True):
            name = f"blk.{layer}.{proj}.weight"
            t = self.tensors[name]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if shape != (e, rows, k):
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(shape)}, expected {[e, rows, k]} "
                                      "from the file's metadata; the file is corrupt or mislabelled")
            data = np.asarray(t.data)
            if type_name in BLOCK_TYPES:
                data = data.reshape(e, rows, BLOCK_TYPES[type_name].row_bytes(k))
            else:
                data = self.read(name).numpy()
            out.append((type_name, data))
        return out

    def moe_layers(self) -> list[int]:
        return [layer for layer in range(self.hf_config["num_hidden_layers"])
                if f"blk.{layer}.ffn_gate_exps.weight" in self.tensors]


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp permutes llama's q/k rows per head (pairs interleaved); back to transformers' halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _num_experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg["num_local_experts"]


def _hf_config(f: GGUFFile) -> dict:
    """config.json's keys for the file's architecture, from its metadata."""
    g = f.field
    tokens = f.fields.get("tokenizer.ggml.tokens")
    vocab = int(f.tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in f.tensors else len(tokens or ())
    heads = int(g("attention.head_count"))
    cfg = dict(
        vocab_size=vocab, hidden_size=int(g("embedding_length")), num_hidden_layers=int(g("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(g("attention.head_count_kv", heads)),
        max_position_embeddings=int(g("context_length", 4096)), rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_theta=float(g("rope.freq_base", 10000.0)), tie_word_embeddings="output.weight" not in f.tensors,
        hidden_act="silu", attention_dropout=0.0, torch_dtype="float32",
        bos_token_id=f.fields.get("tokenizer.ggml.bos_token_id"), eos_token_id=f.fields.get("tokenizer.ggml.eos_token_id"),
    )  # fmt: skip
    experts, used = int(g("expert_count")), int(g("expert_used_count"))
    moe_i = g("expert_feed_forward_length")
    if f.arch in ("qwen3moe", "qwen2moe"):
        cfg.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=int(moe_i),
                   intermediate_size=int(g("feed_forward_length", moe_i)), decoder_sparse_step=1, mlp_only_layers=[])
        if f.arch == "qwen3moe":
            head_dim = int(g("attention.key_length", cfg["hidden_size"] // heads))
            cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=head_dim,
                       norm_topk_prob=True, attention_bias=False)
        else:
            cfg.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], norm_topk_prob=False,
                       shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length")),
                       use_sliding_window=False, qkv_bias=True)
    elif f.arch == "llama":
        cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=experts,
                   num_experts_per_tok=used, intermediate_size=int(g("feed_forward_length")), sliding_window=None)
        cfg["moe_intermediate_size"] = cfg["intermediate_size"]
    else:  # deepseek2
        rope = int(g("rope.dimension_count"))
        key = int(g("attention.key_length_mla", g("attention.key_length")))
        sigmoid = int(g("expert_gating_func", 1)) == 2
        groups = int(g("expert_group_count", 1))
        q_lora = int(g("attention.q_lora_rank", 0))
        cfg.update(
            model_type="deepseek_v3" if sigmoid else "deepseek_v2",
            architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
            num_key_value_heads=heads, n_routed_experts=experts, num_experts_per_tok=used,
            moe_intermediate_size=int(moe_i), intermediate_size=int(g("feed_forward_length")),
            first_k_dense_replace=int(g("leading_dense_block_count", 0)), n_shared_experts=int(g("expert_shared_count", 0)),
            routed_scaling_factor=float(g("expert_weights_scale", 1.0)), norm_topk_prob=bool(g("expert_weights_norm", False)),
            n_group=groups, topk_group=int(g("expert_group_used_count", 1)), kv_lora_rank=int(g("attention.kv_lora_rank")),
            q_lora_rank=q_lora or None, qk_rope_head_dim=rope, qk_nope_head_dim=key - rope,
            v_head_dim=int(g("attention.value_length_mla", g("attention.value_length"))),
            topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if groups > 1 else "greedy"),
            scoring_func="sigmoid" if sigmoid else "softmax", rope_interleave=True, moe_layer_freq=1,
        )  # fmt: skip
    scaling = g("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = float(g("rope.scaling.factor", 1.0))
        rs = {"rope_type": scaling, "factor": factor}
        if scaling == "yarn":
            rs["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
            if (mul := g("rope.scaling.yarn_log_multiplier")) is not None:
                rs["mscale"] = rs["mscale_all_dim"] = float(mul) / 0.1
        elif scaling != "linear":
            raise UnsupportedError(f"{f.path}: RoPE scaling {scaling!r} is not one strata reads from GGUF (linear, yarn)")
        cfg["rope_scaling"] = rs
    return {k: v for k, v in cfg.items() if v is not None}

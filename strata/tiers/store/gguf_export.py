"""A Hugging Face Qwen3-MoE checkpoint written as a GGUF file with the same weights, for llama.cpp.

    write_gguf(checkpoint_dir, "model.gguf")  # bf16 stays bf16; norms and routers in f32, as llama.cpp wants

The file is what llama.cpp's `convert_hf_to_gguf.py --outtype bf16` writes for `Qwen3MoeForCausalLM`: the
`qwen3moe` architecture's metadata keys, tensors under llama.cpp's names (`token_embd`, `blk.N.attn_q`,
`blk.N.ffn_gate_exps`, ...), each layer's experts stacked into one [E, rows, cols] tensor per projection, 1-D
tensors (norms) and the routers (`ffn_gate_inp`) in f32 (exact: bf16 widens to f32 without rounding), every other
matrix in bf16 byte for byte, and the tokenizer as a GPT-2-style BPE vocabulary (tokens, types, merges, special
ids) padded with `[PADn]` tokens up to the config's `vocab_size`, because llama.cpp sizes the embedding by the
token list. Writing streams: one tensor (one layer's stacked experts, at most) is in memory at a time.

It uses the `gguf` package (llama.cpp's own reader/writer, `pip install gguf`). strata's benchmark writes the same
checkpoint once as safetensors for strata and once as GGUF for llama.cpp, so both engines compute the same weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from strata.errors import CheckpointError, UnsupportedError
from strata.tiers.store.safetensors_index import TensorIndex

ARCH = "qwen3moe"
SUPPORTED_MODEL_TYPES = ("qwen3_moe",)
# llama.cpp's GGUF token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise UnsupportedError("writing GGUF needs the gguf package; install it with `pip install gguf`") from e
    return gguf


def write_gguf(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike,
               progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write the Qwen3-MoE checkpoint in `checkpoint_dir` (config.json, safetensors, tokenizer.json) as a bf16 GGUF
    at `out_path` (written beside it under a temporary name, then renamed). `progress(name, done, total)` is told
    after each tensor with the bytes written so far. Returns the path."""
    gguf = _gguf()
    src, out = Path(checkpoint_dir), Path(out_path)
    cfg = _read_json(src / "config.json")
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(f"{src}: GGUF export handles {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints, not "
                               f"{cfg.get('model_type')!r}; export a Qwen3-MoE checkpoint")
    if cfg.get("engram"):
        raise UnsupportedError(f"{src} has Engram layers, which llama.cpp does not run; export a checkpoint without "
                               "them (`strata demo-model --no-engram`)")
    index = TensorIndex.from_dir(src)
    plan = list(_tensor_plan(gguf, index, cfg))
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(tmp, ARCH)
    _add_metadata(gguf, writer, cfg, src.name)
    _add_vocab(gguf, writer, src, int(cfg["vocab_size"]))
    for name, shape, qtype, _ in plan:
        nbytes = int(np.prod(shape)) * (4 if qtype == gguf.GGMLQuantizationType.F32 else 2)
        np_dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.uint16
        writer.add_tensor_info(name, shape, np.dtype(np_dtype), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(int(np.prod(s)) * (4 if q == gguf.GGMLQuantizationType.F32 else 2) for _, s, q, _ in plan)
    done = 0
    try:
        for name, shape, qtype, load in plan:
            t = load()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{src}: tensor for {name} is {list(t.shape)}, expected {list(shape)}")
            if qtype == gguf.GGMLQuantizationType.F32:
                arr = t.to(torch.float32).contiguous().numpy()
            else:  # bf16 bytes as they are: numpy has no bf16, GGUF only needs the bits
                arr = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
            writer.write_tensor_data(arr)
            done += arr.nbytes
            if progress is not None:
                progress(name, done, total)
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a GGUF export needs the checkpoint's config.json and tokenizer.json")
    return json.loads(path.read_text(encoding="utf-8"))


def _add_metadata(gguf, w, cfg: dict, name: str) -> None:
    """The keys llama.cpp's converter writes for Qwen3-MoE (TextModel + Qwen2MoeModel.set_gguf_parameters)."""
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise UnsupportedError(f"GGUF export does not write RoPE scaling {rope!r}; export a checkpoint without it")
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _tensor_plan(gguf, index: TensorIndex, cfg: dict) -> Iterator[tuple[str, tuple[int, ...], object, Callable]]:
    """(GGUF name, numpy-order shape, GGML type, loader) for every tensor, in file order: the dense tensors
    under their llama.cpp names, each layer's experts stacked per projection."""
    layers, experts = int(cfg["num_hidden_layers"]), int(cfg["num_experts"])
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedError("GGUF export handles Qwen3-MoE checkpoints whose every layer is MoE; "
                               "this one has dense layers (mlp_only_layers / decoder_sparse_step)")
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, layers)
    f32, bf16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.BF16
    for info in index:
        if ".mlp.experts." in info.name:  # below, stacked
            continue
        if info.name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        new = names.get_name(info.name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UnsupportedError(f"GGUF export has no llama.cpp name for tensor {info.name!r}")
        router = new.endswith("ffn_gate_inp.weight")
        qtype = f32 if len(info.shape) <= 1 or new.endswith("_norm.weight") or router else bf16
        yield new, tuple(info.shape), qtype, (lambda n=info.name: index.load(n))
    for layer in range(layers):
        for proj, gguf_name in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            shape, load = _stacked_experts(index, layer, experts, proj)
            yield f"blk.{layer}.{gguf_name}.weight", shape, bf16, load


def _stacked_experts(index: TensorIndex, layer: int, experts: int, proj: str) -> tuple[tuple[int, ...], Callable]:
    """(shape [E, rows, cols], loader) of one layer's experts' `proj` ("gate", "up", "down") stacked: from one
    tensor per expert (`experts.E.gate_proj.weight`) or the fused layout (`experts.gate_up_proj` [E, 2I, H]: gate
    rows, then up rows; `experts.down_proj` [E, H, I])."""
    prefix = f"model.layers.{layer}.mlp.experts"
    per_expert = [f"{prefix}.{e}.{proj}_proj.weight" for e in range(experts)]
    if all(n in index for n in per_expert):
        return (experts, *index[per_expert[0]].shape), lambda: torch.stack([index.load(n) for n in per_expert])
    if proj != "down" and f"{prefix}.gate_up_proj" in index:
        full = index[f"{prefix}.gate_up_proj"]
        half = full.shape[1] // 2
        rows = slice(0, half) if proj == "gate" else slice(half, 2 * half)
        return (experts, half, full.shape[2]), lambda: index.load(full.name)[:, rows, :]
    if proj == "down" and f"{prefix}.down_proj" in index:
        return tuple(index[f"{prefix}.down_proj"].shape), lambda: index.load(f"{prefix}.down_proj")
    raise CheckpointError(f"layer {layer}'s {proj} experts are missing from the checkpoint "
                          f"(neither {per_expert[0]} nor {prefix}.gate_up_proj / down_proj)")


def _add_vocab(gguf, w, src: Path, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's gpt2 (byte-level BPE) vocabulary, as `_set_vocab_gpt2` writes it."""
    from tokenizers import Tokenizer

    path = src / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a GGUF export needs the checkpoint's tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = {a["id"]: a for a in json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])}
    if by_id and max(by_id) >= vocab_size:
        raise CheckpointError(f"{path} has token id {max(by_id)}, beyond config.json's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(_CONTROL if added[i].get("special") else _USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(_NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the byte-level pre-tokenizer with GPT-2's split regex
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(src, load_merges=True).add_to_gguf(w)

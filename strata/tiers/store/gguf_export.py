"""A Hugging Face Qwen3-MoE or DeepSeek-V3/V2 checkpoint written as a GGUF file with the same weights, for llama.cpp.

    write_gguf(checkpoint_dir, "model.gguf")                      # bf16 stays bf16; norms and routers in f32
    write_gguf(checkpoint_dir, "model-q4_k_m.gguf", experts="q4_k_m")   # routed experts in llama.cpp's Q4_K_M

The bf16 file is what llama.cpp's `convert_hf_to_gguf.py --outtype bf16` writes: the architecture's metadata keys
(`qwen3moe` for Qwen3MoeForCausalLM; `deepseek2` for DeepseekV3/V2ForCausalLM, MLA's sizes in the `_mla` keys and
one KV head, its MQA form), tensors under llama.cpp's names (`token_embd`, `blk.N.attn_q`, `blk.N.ffn_gate_exps`,
...), each layer's experts stacked into one [E, rows, cols] tensor per projection, MLA's kv_b split into `attn_k_b`
[heads, rank, nope] and `attn_v_b` [heads, v, rank], `e_score_correction_bias` as `exp_probs_b.bias`, 1-D tensors
(norms, biases) and the routers (`ffn_gate_inp`) in f32 (exact: bf16 widens to f32 without rounding), every other
matrix in bf16 byte for byte, and the tokenizer as a GPT-2-style BPE vocabulary (tokens, types, merges, special
ids) padded with `[PADn]` tokens up to the config's `vocab_size`, because llama.cpp sizes the embedding by the
token list.

`experts` (strata.tiers.store.gguf_mix) writes the routed experts in a ggml block type instead, quantized by
strata.tiers.store.gguf_quantize (llama.cpp's reference quantizers); everything else stays as in the bf16 file.
`tensor_type` overrides the choice per tensor. Writing streams: one tensor (one layer's stacked experts, at most)
is in memory at a time; a quantized one is quantized in row chunks on `threads` threads.

It uses the `gguf` package (llama.cpp's own reader/writer, `pip install gguf`). strata's benchmark writes the same
checkpoint once as safetensors for strata and once as GGUF for llama.cpp, so both engines compute the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from strata.errors import CheckpointError, StrataError, UnsupportedError
from strata.tiers.store.gguf_mix import FILE_TYPES, check_export_type, tensor_types
from strata.tiers.store.gguf_quantize import block_shape, quantize_rows
from strata.tiers.store.safetensors_index import TensorIndex

ARCHES = {"qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}  # model_type -> GGUF
SUPPORTED_MODEL_TYPES = tuple(ARCHES)
# llama.cpp's GGUF token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
_CHUNK_VALUES = 1 << 21  # values quantized per task (8 MiB of float32)


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise UnsupportedError("writing GGUF needs the gguf package; install it with `pip install gguf`") from e
    return gguf


def tensor_nbytes(type_name: str, shape: tuple[int, ...], name: str = "") -> int:
    """Bytes of a tensor `name` of `shape` (numpy order) stored as GGML type `type_name`; a one-line
    `UnsupportedError` when its rows do not split into the type's blocks."""
    n = int(np.prod(shape))
    if type_name in ("F32", "BF16"):
        return n * (4 if type_name == "F32" else 2)
    values, nbytes = block_shape(type_name)
    if shape[-1] % values:
        raise UnsupportedError(f"{name or 'a tensor'}: rows of {shape[-1]} values do not split into {type_name}'s "
                               f"{values}-value blocks; give it another type")
    return n // values * nbytes


def write_gguf(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike,
               progress: Callable[[str, int, int], None] | None = None, experts: str = "bf16",
               tensor_type: Callable[[str, tuple[int, ...]], str] | None = None, threads: int | None = None) -> Path:
    """Write the checkpoint in `checkpoint_dir` (config.json, safetensors, tokenizer.json) as a GGUF at `out_path`
    (written beside it under a temporary name, then renamed), its routed experts in `experts` (one of
    `gguf_mix.EXPORT_TYPES`). `tensor_type(gguf_name, shape) -> GGML type name` ("F32", "BF16", "Q8_0", "Q4_K", ...)
    replaces the export's choice per tensor. `progress(name, done, total)` is told after each tensor with the bytes
    written so far. A one-line error, before anything is written, when the disk lacks the room. Returns the path."""
    gguf = _gguf()
    check_export_type(experts)
    src, out = Path(checkpoint_dir), Path(out_path)
    cfg = _read_json(src / "config.json")
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(f"{src}: GGUF export handles Qwen3-MoE and DeepSeek-V3/V2 checkpoints "
                               f"({', '.join(SUPPORTED_MODEL_TYPES)}), not {cfg.get('model_type')!r}; export one of those")
    if cfg.get("engram"):
        raise UnsupportedError(f"{src} has Engram layers, which llama.cpp does not run; export a checkpoint without "
                               "them (`strata demo-model --no-engram`)")
    arch = ARCHES[cfg["model_type"]]
    index = TensorIndex.from_dir(src)
    type_of = tensor_type or tensor_types(experts, int(cfg["num_hidden_layers"]))
    plan = [(name, shape, type_of(name, shape), load) for name, shape, load in _tensor_plan(gguf, arch, index, cfg)]
    total = sum(tensor_nbytes(t, s, n) for n, s, t, _ in plan)  # every type checked before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if total + (64 << 20) > free:  # the header and vocabulary: a few MiB
        raise StrataError(f"{out.parent}: the GGUF needs about {total / 1e9:.2f} GB but {free / 1e9:.2f} GB are free; "
                          "free space or write it elsewhere")
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    (_add_qwen3_metadata if arch == "qwen3moe" else _add_deepseek2_metadata)(writer, cfg, src.name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[experts]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(gguf, writer, src, int(cfg["vocab_size"]))
    for name, shape, qtype, _ in plan:
        nbytes = tensor_nbytes(qtype, shape)
        if qtype in ("F32", "BF16"):  # the element shape; numpy has no bf16, so its bits go as uint16
            writer.add_tensor_info(name, shape, np.dtype(np.float32 if qtype == "F32" else np.uint16), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:  # the byte shape [..., rows, row bytes], which gguf turns back into the element shape
            values, block = block_shape(qtype)
            writer.add_tensor_info(name, (*shape[:-1], shape[-1] // values * block), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    pool = ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1), thread_name_prefix="strata-gguf")
    try:
        for name, shape, qtype, load in plan:
            t = load()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{src}: tensor for {name} is {list(t.shape)}, expected {list(shape)}")
            arr = _encode(t, qtype, pool)
            writer.write_tensor_data(arr)
            done += arr.nbytes
            if progress is not None:
                progress(name, done, total)
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    os.replace(tmp, out)
    return out


def _encode(t: torch.Tensor, qtype: str, pool: ThreadPoolExecutor) -> np.ndarray:
    """A tensor's bytes as GGUF stores them: f32, bf16 bits as uint16, or blocks of `qtype` (rows quantized in
    chunks of about `_CHUNK_VALUES` values on `pool`: numpy's operations release the GIL)."""
    if qtype == "F32":
        return t.to(torch.float32).contiguous().numpy()
    if qtype == "BF16":  # bf16 bytes as they are: numpy has no bf16, GGUF only needs the bits
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    k = t.shape[-1]
    rows = t.reshape(-1, k)
    values, block = block_shape(qtype)
    out = np.empty((rows.shape[0], k // values * block), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // k)

    def one(start: int) -> None:
        out[start : start + step] = quantize_rows(rows[start : start + step].to(torch.float32).numpy(), qtype)

    for f in [pool.submit(one, start) for start in range(0, rows.shape[0], step)]:
        f.result()
    return out.reshape(*t.shape[:-1], k // values * block)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a GGUF export needs the checkpoint's config.json and tokenizer.json")
    return json.loads(path.read_text(encoding="utf-8"))


def _add_common(w, cfg: dict, name: str) -> None:
    """The keys TextModel.set_gguf_parameters writes for every architecture."""
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    rope = cfg.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise UnsupportedError(f"GGUF export does not write RoPE scaling {rope!r}; export a checkpoint without it")
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_used_count(cfg["num_experts_per_tok"])


def _add_qwen3_metadata(w, cfg: dict, name: str) -> None:
    """The keys llama.cpp's converter writes for Qwen3-MoE (TextModel + Qwen2MoeModel.set_gguf_parameters)."""
    _add_common(w, cfg, name)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_expert_count(cfg["num_experts"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _add_deepseek2_metadata(w, cfg: dict, name: str) -> None:
    """The keys llama.cpp's converter writes for DeepSeek-V3/V2 (TextModel + DeepseekV2Model.set_gguf_parameters):
    MLA as MQA (one KV head of kv_lora_rank + rope values), its per-head sizes in the `_mla` keys."""
    import gguf

    _add_common(w, cfg, name)
    w.add_head_count_kv(1)
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_group_count(int(cfg.get("n_group") or 1))
    w.add_expert_group_used_count(int(cfg.get("topk_group") or 1))
    sigmoid = cfg.get("scoring_func", "softmax") == "sigmoid"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(int(cfg.get("first_k_dense_replace", 0)))
    w.add_vocab_size(cfg["vocab_size"])
    # 0 for none: llama.cpp reads the key unless the layer count is V2-Lite's (27), then projects q directly at 0
    w.add_q_lora_rank(int(cfg.get("q_lora_rank") or 0))
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(int(cfg.get("n_shared_experts") or 0))
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)


def _tensor_plan(gguf, arch: str, index: TensorIndex, cfg: dict) -> Iterator[tuple[str, tuple[int, ...], Callable]]:
    """(GGUF name, numpy-order shape, loader) for every tensor, in file order: the dense tensors under their
    llama.cpp names (MLA's kv_b as its two halves), each MoE layer's experts stacked per projection."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "qwen3moe":
        experts, moe_layers = int(cfg["num_experts"]), range(layers)
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise UnsupportedError("GGUF export handles Qwen3-MoE checkpoints whose every layer is MoE; "
                                   "this one has dense layers (mlp_only_layers / decoder_sparse_step)")
        names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3MOE, layers)
    else:
        experts, moe_layers = int(cfg["n_routed_experts"]), range(int(cfg.get("first_k_dense_replace", 0)), layers)
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise UnsupportedError("GGUF export handles DeepSeek checkpoints with moe_layer_freq 1 (llama.cpp's "
                                   "deepseek2 reads no other); export one with every layer past the dense ones MoE")
        names = gguf.TensorNameMap(gguf.MODEL_ARCH.DEEPSEEK2, layers)
    for info in index:
        if ".mlp.experts." in info.name:  # below, stacked
            continue
        if info.name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if info.name.endswith("kv_b_proj.weight"):  # llama.cpp splits MLA's kv_b for its absorbed attention
            yield from _split_kv_b(names, info.name, index, cfg)
            continue
        hf = info.name.replace("e_score_correction_bias", "e_score_correction.bias")  # as the converter renames it
        new = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UnsupportedError(f"GGUF export has no llama.cpp name for tensor {info.name!r}")
        yield new, tuple(info.shape), (lambda n=info.name: index.load(n))
    for layer in moe_layers:
        for proj, gguf_name in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            shape, load = _stacked_experts(index, layer, experts, proj)
            yield f"blk.{layer}.{gguf_name}.weight", shape, load


def _split_kv_b(names, hf_name: str, index: TensorIndex, cfg: dict) -> Iterator[tuple[str, tuple[int, ...], Callable]]:
    """kv_b_proj [heads * (nope + v), rank] as llama.cpp's attn_k_b [heads, rank, nope] (transposed) and
    attn_v_b [heads, v, rank]."""
    heads, nope, v, rank = (int(cfg[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim",
                                                    "kv_lora_rank"))
    if tuple(index[hf_name].shape) != (heads * (nope + v), rank):
        raise CheckpointError(f"{hf_name} is {list(index[hf_name].shape)}, not [{heads * (nope + v)}, {rank}] as the "
                              "config's MLA sizes say")
    prefix = names.get_name(hf_name, try_suffixes=(".weight",)).rsplit(".", 2)[0]

    def part(keys: slice, transpose: bool) -> torch.Tensor:
        kv = index.load(hf_name).view(heads, nope + v, rank)[:, keys]
        return (kv.transpose(1, 2) if transpose else kv).contiguous()

    yield f"{prefix}.attn_k_b.weight", (heads, rank, nope), lambda: part(slice(0, nope), True)
    yield f"{prefix}.attn_v_b.weight", (heads, v, rank), lambda: part(slice(nope, nope + v), False)


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

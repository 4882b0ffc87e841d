"""Which GGML type each tensor of an exported GGUF gets (`strata demo-model --gguf TYPE`, `write_gguf(experts=...)`).

| TYPE | routed experts (`ffn_{gate,up,down}_exps`) |
| --- | --- |
| `bf16` | BF16 |
| `q8_0`, `q6_k`, `q5_k`, `q4_k`, `q2_k` | that type, every layer and projection |
| `q4_k_m` | llama.cpp's Q4_K_M: gate and up Q4_K; down Q6_K on `use_more_bits` layers (the first and last eighth of the layers and every third between), Q4_K on the others, as `llama_tensor_get_type` picks for `ffn_down_exps` |

Every other tensor is written as the bf16 export writes it, whatever TYPE: 1-D tensors, norms, routers
(`ffn_gate_inp`) and biases in F32, every other matrix (embedding, LM head, attention, dense MLPs, shared experts) in
BF16. llama.cpp's own Q4_K_M would also quantize those (attention Q4_K / Q6_K, `output` Q6_K, `token_embd` Q4_K);
they stay bf16 here so that both engines compute the very same dense weights: strata dequantizes a file's dense
tensors to its compute dtype when it loads them, and a K-quant's values (f16 scale x 6-bit sub-scale x q) do not all
fit bf16, so strata in bf16 would round them while llama.cpp would not. Only the routed experts, which strata keeps
in their blocks, differ from the bf16 export.

K-quant blocks hold 256 values of a row: a model whose experts' rows are not a multiple of 256 (the `tiny` demo's
64 and 32) can be exported in bf16 or q8_0 (32-value blocks) only; llama.cpp would fall back to Q5_0 / Q5_1 /
Q8_0 there, types strata does not keep experts in.
"""

from __future__ import annotations

from collections.abc import Callable

from strata.errors import UnsupportedError

EXPORT_TYPES = ("bf16", "q8_0", "q6_k", "q5_k", "q4_k", "q4_k_m", "q2_k")
EXPERT_PROJS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# general.file_type: the llama.cpp mix each export is closest to (llama.cpp prints it; it reads each tensor's type)
FILE_TYPES = {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q6_k": "MOSTLY_Q6_K", "q5_k": "MOSTLY_Q5_K_S",
              "q4_k": "MOSTLY_Q4_K_S", "q4_k_m": "MOSTLY_Q4_K_M", "q2_k": "MOSTLY_Q2_K"}
_BLOCK_VALUES = {"Q8_0": 32, "Q2_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def check_export_type(export: str) -> str:
    """`export` if it is one of `EXPORT_TYPES`; a one-line `UnsupportedError` otherwise."""
    if export not in EXPORT_TYPES:
        raise UnsupportedError(f"GGUF type {export!r} is not one strata writes; use one of {', '.join(EXPORT_TYPES)}")
    return export


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose ffn_down gets more bits in the *_M mixes: the first and last eighth,
    and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def expert_type(export: str, proj: str, layer: int, layers: int) -> str:
    """The GGML type name of layer `layer`'s (of `layers`) routed experts' `proj` (one of `EXPERT_PROJS`)."""
    if export == "bf16":
        return "BF16"
    if export == "q4_k_m":
        return "Q6_K" if proj == "ffn_down_exps" and use_more_bits(layer, layers) else "Q4_K"
    return export.upper()


def tensor_types(export: str, layers: int) -> Callable[[str, tuple[int, ...]], str]:
    """`type_of(gguf_name, shape) -> GGML type name` for an export of `export` of a `layers`-layer model; raises a
    one-line `UnsupportedError` for experts whose rows do not split into the type's blocks."""
    check_export_type(export)

    def type_of(name: str, shape: tuple[int, ...]) -> str:
        base = name.rsplit(".", 1)[0].split(".")[-1]
        if len(shape) <= 1 or base.endswith("_norm") or base == "ffn_gate_inp" or not name.endswith(".weight"):
            return "F32"
        if base not in EXPERT_PROJS:
            return "BF16"
        kind = expert_type(export, base, int(name.split(".")[1]), layers)
        if kind in _BLOCK_VALUES and shape[-1] % _BLOCK_VALUES[kind]:
            fits = [t for t in ("q8_0", "bf16") if t == "bf16" or shape[-1] % _BLOCK_VALUES[t.upper()] == 0]
            raise UnsupportedError(f"{name}: rows of {shape[-1]} values do not split into {kind}'s "
                                   f"{_BLOCK_VALUES[kind]}-value blocks; export this model as {' or '.join(fits)}")
        return kind

    return type_of

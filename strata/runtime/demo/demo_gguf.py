"""`strata demo-model DIR --gguf TYPE`: a random-weight demo model also written as a GGUF, for llama.cpp.

The GGUF is `DIR/model-TYPE.gguf`, beside the safetensors checkpoint it is exported from
(strata.tiers.store.gguf_export, types in strata.tiers.store.gguf_mix): the very same weights, routed experts in TYPE.
strata reads it too (`strata convert DIR/model-q4_k_m.gguf STORE`, or `strata generate DIR/model-q4_k_m.gguf`), so
both engines can run one file. The file is written under a temporary name and renamed, so one that exists is whole
and is kept.

What llama.cpp runs: Qwen3-MoE (`bench`; `qwen3moe`) and DeepSeek-V3/V2 (`tiny`, `small`, `--arch deepseek_v2`;
`deepseek2`), written without Engram layers (`--no-engram`). K-quants need expert rows of a multiple of 256 values:
`small` and `bench` take every TYPE, `tiny` (rows of 64 and 32) bf16 and q8_0.
"""

from __future__ import annotations

from pathlib import Path

from strata.errors import ConfigError


def demo_gguf_path(model_dir: str | Path, export: str) -> Path:
    """Where `--gguf export` writes the GGUF of the demo model in `model_dir`."""
    return Path(model_dir) / f"model-{export}.gguf"


def check_demo_gguf(export: str, size: str, layers: int | None, engram: bool, arch: str | None,
                    experts: str = "bf16") -> None:
    """Refuse, before anything is written, a `--gguf export` of a demo model that cannot be exported: a one-line
    `ConfigError` or `UnsupportedError` naming the option to change."""
    from strata.runtime.demo.configs import TRAINED_SIZE, demo_config
    from strata.tiers.store.gguf_export import SUPPORTED_MODEL_TYPES
    from strata.tiers.store.gguf_mix import check_export_type, tensor_types

    check_export_type(export)
    if size == TRAINED_SIZE:
        raise ConfigError("--gguf: the trained demo model has Engram layers, which llama.cpp does not run; export a "
                          "random size instead (--size tiny|small|bench --no-engram)")
    if engram:
        raise ConfigError("--gguf: llama.cpp does not run Engram layers; add --no-engram")
    if experts != "bf16":
        raise ConfigError(f"--gguf exports the bf16 weights, its TYPE quantizes the experts; leave out --experts {experts}")
    cfg = demo_config(size, layers, engram=False, arch=arch)
    if cfg["model_type"] not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"--gguf writes {', '.join(SUPPORTED_MODEL_TYPES)} models, not {cfg['model_type']} (--arch "
                          f"{arch}); leave out --arch or use deepseek_v2")
    type_of = tensor_types(export, cfg["num_hidden_layers"])
    experts_count = cfg.get("num_experts") or cfg["n_routed_experts"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for layer in range(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"]):
        for proj, shape in (("gate", (experts_count, inter, hidden)), ("down", (experts_count, hidden, inter))):
            type_of(f"blk.{layer}.ffn_{proj}_exps.weight", shape)  # raises for rows that do not split into blocks


def write_demo_gguf(model_dir: str | Path, export: str, progress: bool = True, threads: int | None = None) -> Path:
    """`demo_gguf_path(model_dir, export)`, exported from the demo model in `model_dir` unless it exists; a tqdm
    bar over the bytes written when `progress`. Returns the path."""
    from tqdm.auto import tqdm

    from strata.tiers.store.gguf_export import write_gguf

    out = demo_gguf_path(model_dir, export)
    if out.is_file():
        return out
    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=f"gguf {export}", disable=not progress)

    def step(name: str, done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        return write_gguf(model_dir, out, step, experts=export, threads=threads)
    finally:
        bar.close()

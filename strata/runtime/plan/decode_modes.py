"""Which decode path a tiered model takes for its experts' format, and what it falls back to where a kernel does not
read the format (strata.kernels.quant.FAST_PATHS): said by `strata plan` and followed by the build.

Plain experts (the checkpoint's bf16/f16/f32) take every fast path; FP8, MXFP4 and GGUF experts the paths whose kernel
reads them in place. Where a kernel does not, the runtime dequantizes each expert into a scratch of the compute dtype
as it runs it (strata.kernels.experts.as_weights): exact against the dequantized weights, slower, and, on the GPU,
without CUDA graphs (the per-expert loop needs the host between layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.config import StrataConfig
from strata.kernels.quant import ExpertFormat, reads


@dataclass
class DecodeMode:
    """How decode steps compute routed experts (`mode`), whether they may run as CUDA graphs, and each fallback the
    format forces (one line each, with the reason)."""

    mode: str
    graphs: bool = True
    fallbacks: list[str] = field(default_factory=list)


def decode_mode(fmt: ExpertFormat, expert_compute: str, all_in_vram: bool, cfg: StrataConfig,
                dtype: str = "bfloat16") -> DecodeMode:
    """The decode path of a tiered model whose experts are stored in `fmt`, computed on `expert_compute` ("gpu":
    a GPU tier; "cpu": CPU threads from RAM), `all_in_vram` when the GPU's budget holds every expert; `dtype` is
    the compute dtype fallbacks dequantize to."""
    name, rt = fmt.name, cfg.runtime
    fork = rt.cpu_numerics == "fork"
    cpu_reads, pairs_read = reads("cpu_kernel", fmt), reads("gpu_pairs", fmt)
    cpu_fallback = (f"the compiled CPU kernel does not read {name} experts: the CPU's share dequantizes each one to "
                    "float32 and runs the reference math")
    if expert_compute == "cpu":
        if not fork:
            return DecodeMode("experts on CPU threads from RAM through the reference math (runtime.cpu_numerics = "
                              '"gpu")')
        if cpu_reads:
            return DecodeMode("experts on CPU threads from RAM, the compiled kernel")
        return DecodeMode("experts on CPU threads from RAM, dequantized one by one (reference math)",
                          fallbacks=[cpu_fallback])
    out = DecodeMode("")
    if not pairs_read:
        out.mode = (f"experts grouped by expert: each staged in a GPU slot and dequantized into a {dtype} scratch "
                    "before its matrix products; no CUDA graphs")
        out.graphs = False
        out.fallbacks.append(f"the GPU's decode pair kernels do not read {name} experts: decode groups a step's "
                             "tokens by expert and dequantizes each (slower; no CUDA graphs, no one-graph split "
                             "decode)")
        if fork and not cpu_reads:
            out.fallbacks.append(cpu_fallback)
    elif all_in_vram:
        out.mode = "every expert in VRAM: one CUDA graph a step, the pair kernels reading the slots"
    elif not fork:
        out.mode = "resident experts by the pair kernels; cold ones copied into GPU slots first (bit-identical)"
    elif cfg.debug.split_decode == "graph" and reads("cpu_mailbox", fmt):
        out.mode = ("split: resident experts by the GPU's pair kernels, cold ones by the CPU worker, one CUDA graph a "
                    "step once every expert is in pinned RAM (host steps until then)")
    else:
        out.mode = "split: resident experts by the GPU's pair kernels, cold ones on CPU threads (host steps)"
        if not cpu_reads:
            out.fallbacks.append(cpu_fallback + "; one-graph split decode is off")
        elif cfg.debug.split_decode == "graph":
            out.fallbacks.append(f"one-graph split decode's CPU worker does not read {name} experts yet: split "
                                 "decode runs host steps (a CUDA graph a layer, the CPU kernel started between them)")
    if not reads("gpu_grouped", fmt):
        out.fallbacks.append(f"prefill's grouped GEMMs do not read {name} experts: prefill dequantizes each expert "
                             "before its matrix products")
    return out

"""Demo checkpoints in the formats model makers ship quantized models in (`strata demo-model --experts fp8|mxfp4`).

The weights are the bf16 model's (same seed, same values before rounding), written as released checkpoints hold
them:

- fp8: every linear weight but the embeddings, lm_head, routers and Engram's as block-scaled e4m3
  (`...weight` F8_E4M3 + `...weight_scale_inv` F32, one scale per block), with `quantization_config`
  {quant_method "fp8", fmt "e4m3", weight_block_size}, as DeepSeek-V3 ships; experts stay one tensor per
  projection. The block is `fp8_block_for` the expert width: 128 x 128 for the small and bench sizes, 32 x 32 for tiny.
- mxfp4: the routed experts only, fused per layer as gpt-oss ships them (`mlp.experts.gate_up_proj_blocks`
  [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32], `down_proj_blocks` / `_scales`); everything else stays bf16.

Writing is split into jobs (`WeightJob`) that each generate their source tensors and write their outputs by offset:
one tensor, one FP8 pair, or one expert's rows of the fused MXFP4 tensors, so memory stays at a few tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from strata.kernels.quant import MX_GROUP, fp8_block_for, quantize_fp8, quantize_mxfp4
from strata.runtime.demo.weights import TensorSpec

DEMO_EXPERTS = ("bf16", "fp8", "mxfp4")  # `--experts`: the routed experts' (and, for fp8, the linear weights') format
_FP8_KEEP = re.compile(r"(embed_tokens|lm_head|\.(mlp|block_sparse_moe)\.gate\.weight|\.engram\.)")  # stay bf16 in FP8
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


@dataclass(frozen=True)
class WeightJob:
    """One unit of writing: `sources` generated as the bf16 model's tensors, written as `outputs`.

    kind "plain": the one source as it is; "fp8": values and scale_inv of the one source in `block`; "mxfp4": an
    expert's gate, up and down into its rows (`expert` of `num_experts`) of the four fused outputs."""

    kind: str
    sources: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    block: tuple[int, int] = (128, 128)
    expert: int = 0
    num_experts: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes this job writes."""
        if self.kind == "mxfp4":
            return sum(t.nbytes for t in self.outputs) // self.num_experts
        return sum(t.nbytes for t in self.outputs)

    def tensors(self, make) -> list[tuple[str, int, torch.Tensor]]:
        """(output name, byte offset inside it, uint8 bytes) to write, from `make(spec) -> tensor` of each source."""
        if self.kind == "plain":
            return [(self.outputs[0].name, 0, _bytes(make(self.sources[0])))]
        if self.kind == "fp8":
            q, s = quantize_fp8(make(self.sources[0]).float(), self.block)
            return [(self.outputs[0].name, 0, _bytes(q)), (self.outputs[1].name, 0, _bytes(s))]
        gate, up, down = (make(s).float() for s in self.sources)
        out = []
        for (blocks, scales), w in zip((self.outputs[:2], self.outputs[2:]), (torch.cat([gate, up]), down), strict=True):
            q, s = quantize_mxfp4(w)  # [N, K/2], [N, K/32]
            out += [(blocks.name, self.expert * q.numel(), _bytes(q)), (scales.name, self.expert * s.numel(), _bytes(s))]
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def quantization_config(experts: str, cfg: dict) -> dict | None:
    """config.json's `quantization_config` of a demo model written with `--experts` (None: bf16)."""
    if experts == "fp8":
        block = fp8_block_for(_expert_width(cfg))
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if experts == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.embed_tokens", "lm_head", "self_attn",
                                                                     "mlp.gate", "shared_experts", "engram"]}
    return None


def weight_jobs(specs: list[TensorSpec], experts: str, cfg: dict) -> tuple[list[TensorSpec], list[WeightJob]]:
    """(every tensor written, in checkpoint order; the jobs writing them) for the bf16 model's `specs` in `experts`."""
    if experts == "bf16":
        return specs, [WeightJob("plain", (s,), (s,)) for s in specs]
    if experts == "fp8":
        block = fp8_block_for(_expert_width(cfg))
        outputs, jobs = [], []
        for s in specs:
            if len(s.shape) == 2 and s.name.endswith(".weight") and not _FP8_KEEP.search(s.name):
                values = TensorSpec(s.name, s.shape, "F8_E4M3")
                scale = TensorSpec(s.name + "_scale_inv", (-(-s.shape[0] // block[0]), -(-s.shape[1] // block[1])), "F32")
                outputs += [values, scale]
                jobs.append(WeightJob("fp8", (s,), (values, scale), block))
            else:
                outputs.append(s)
                jobs.append(WeightJob("plain", (s,), (s,)))
        return outputs, jobs
    return _mxfp4_jobs(specs)


def _expert_width(cfg: dict) -> int:
    """A config.json's routed expert width (MiniMax-M2 and Mixtral call it intermediate_size)."""
    return cfg.get("moe_intermediate_size") or cfg["intermediate_size"]


def _mxfp4_jobs(specs: list[TensorSpec]) -> tuple[list[TensorSpec], list[WeightJob]]:
    """Routed experts fused per layer into MXFP4 blocks and scales (written where the layer's first expert was)."""
    by_expert: dict[tuple[int, int], dict[str, TensorSpec]] = {}
    for s in specs:
        if m := _EXPERT.fullmatch(s.name):
            by_expert.setdefault((int(m[1]), int(m[2])), {})[m[3]] = s
    outputs, jobs, fused = [], [], {}
    for s in specs:
        m = _EXPERT.fullmatch(s.name)
        if m is None:
            outputs.append(s)
            jobs.append(WeightJob("plain", (s,), (s,)))
            continue
        layer = int(m[1])
        if layer not in fused:  # the layer's four fused tensors, from its expert 0's shapes
            n = sum(1 for key in by_expert if key[0] == layer)
            first = by_expert[(layer, 0)]
            (inter, hidden) = first["gate"].shape
            stem = f"model.layers.{layer}.mlp.experts."
            fused[layer] = (
                TensorSpec(stem + "gate_up_proj_blocks", (n, 2 * inter, hidden // MX_GROUP, MX_GROUP // 2), "U8"),
                TensorSpec(stem + "gate_up_proj_scales", (n, 2 * inter, hidden // MX_GROUP), "U8"),
                TensorSpec(stem + "down_proj_blocks", (n, hidden, inter // MX_GROUP, MX_GROUP // 2), "U8"),
                TensorSpec(stem + "down_proj_scales", (n, hidden, inter // MX_GROUP), "U8"),
            )
            outputs.extend(fused[layer])
        if m[3] == "gate":  # one job per expert, at its gate tensor
            e, parts = int(m[2]), by_expert[(layer, int(m[2]))]
            n = fused[layer][0].shape[0]
            jobs.append(WeightJob("mxfp4", (parts["gate"], parts["up"], parts["down"]), fused[layer], expert=e,
                                  num_experts=n))
    return outputs, jobs

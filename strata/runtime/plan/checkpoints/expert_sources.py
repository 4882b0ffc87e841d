"""Where each routed expert's bytes are in a checkpoint, for `strata convert`: its matrices' values and scales.

An expert is gate_up [2I, H] and down [H, I]. A per-expert checkpoint ships gate [I, H] and up [I, H] apart
(`experts.E.gate_proj.weight`, Mixtral's `w1`/`w3`), a fused one slices `experts.gate_up_proj` [E, 2I, H]; either
way, in the checkpoint's expert format (strata.runtime.model.quantized): plain values, FP8 values with their
`_scale_inv` blocks, or MXFP4 `_blocks` with `_scales`. When the store keeps that format the blob is a byte copy
of those parts into the sections of `ExpertLayout` (`ExpertSource.pieces`); otherwise the converter reads the
expert as fp32 weights (`ExpertSource.weights`) and packs it into the store's format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from strata.config_sections import STORE_EXPERTS
from strata.errors import CheckpointError, ConfigError
from strata.kernels.quant import MX_GROUP, ExpertFormat, ExpertLayout, dequantize_fp8, dequantize_mxfp4, fp8_block_for
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.gpt_oss.layout import transposed_shapes
from strata.tiers.store.safetensors_header import FP8_SCALE, MX_BLOCKS, MX_SCALES, TensorInfo
from strata.tiers.store.safetensors_index import read_tensor

Piece = tuple[Path, int, int, int]  # (source file, absolute offset, bytes, offset in the blob)
Part = tuple[TensorInfo, TensorInfo | None]  # one matrix (or gate / up half) as stored: values, scales


def store_format(src: ExpertFormat, experts: str, hidden: int, intermediate: int, where: str) -> ExpertFormat:
    """The format a store keeps routed experts in whose checkpoint ships them in `src`: `src` itself ("checkpoint",
    or the kind it already has), or a plain checkpoint's experts quantized to "fp8" (square blocks: `fp8_block_for`,
    128 x 128 whenever the intermediate size allows) or "mxfp4". One-line `ConfigError` naming `where` when the shapes
    do not allow it or the experts are already quantized to the other kind."""
    if experts not in STORE_EXPERTS:
        raise ConfigError(f"experts {experts!r} is not one of {', '.join(STORE_EXPERTS)}")
    if experts == "checkpoint" or experts == src.kind:
        fmt = src
    elif src.quantized:
        raise ConfigError(f"{where}: its experts are already {src.name}; strata does not requantize them to {experts}: "
                          'use experts = "checkpoint"')
    else:
        try:
            fmt = ExpertFormat("fp8", block=fp8_block_for(intermediate)) if experts == "fp8" else ExpertFormat("mxfp4")
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    try:
        ExpertLayout.build(fmt, hidden, intermediate)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return fmt


@dataclass(frozen=True)
class ExpertSource:
    """One expert in the checkpoint: gate_up as its parts in row order (gate, up; or the fused rows), and down."""

    fmt: ExpertFormat
    gate_up: tuple[Part, ...]
    down: Part
    transposed: bool = False  # parts stored [H, 2I] and [I, H] (transformers' gpt-oss in bf16): never byte copies

    def pieces(self, layout: ExpertLayout) -> list[Piece] | None:
        """The blob as byte copies into `layout`'s sections (the store keeps the checkpoint's format), or None when
        a part is not stored as the blob holds it (scales in another dtype than float32: read and converted)."""
        if layout.fmt != self.fmt or self.transposed:
            return None
        out: list[Piece] = []
        for parts, values, scales in ((self.gate_up, layout.gate_up, layout.gate_up_scales),
                                      ((self.down,), layout.down, layout.down_scales)):
            v_at, s_at = values.offset, scales.offset if scales is not None else 0
            for v, s in parts:
                out.append((v.file, v.offset, v.nbytes, v_at))
                v_at += v.nbytes
                if s is not None:
                    if self.fmt.kind == "fp8" and s.dtype != "F32":
                        return None
                    out.append((s.file, s.offset, s.nbytes, s_at))
                    s_at += s.nbytes
        return out

    def as_stored(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((gate_up values, scales), (down values, scales)) as read, scales in float32 (FP8) or as stored (MXFP4):
        what `ExpertLayout.pack_quantized` takes when the store keeps the format but a byte copy cannot (scales of
        another dtype)."""
        def part(parts: tuple[Part, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            values = torch.cat([read_tensor(v, raw=True).view(torch.uint8) for v, _ in parts])
            scales = torch.cat([read_tensor(sc, raw=True) for _, sc in parts])
            return values, scales.float() if self.fmt.kind == "fp8" else scales

        return part(self.gate_up), part((self.down,))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) in fp32, dequantized: what the converter packs into another format."""
        gate_up = torch.cat([_dequantized(self.fmt, v, s) for v, s in self.gate_up])
        down = _dequantized(self.fmt, *self.down)
        return (gate_up.T.contiguous(), down.T.contiguous()) if self.transposed else (gate_up, down)

    @property
    def nbytes(self) -> int:
        """Bytes read from the checkpoint for this expert."""
        return sum(v.nbytes + (s.nbytes if s is not None else 0) for v, s in (*self.gate_up, self.down))


def _dequantized(fmt: ExpertFormat, values: TensorInfo, scales: TensorInfo | None) -> torch.Tensor:
    raw = read_tensor(values, raw=True)
    if fmt.kind == "plain":
        return raw.float()
    if fmt.kind == "fp8":
        return dequantize_fp8(raw, read_tensor(scales, raw=True).float(), fmt.block)
    return dequantize_mxfp4(raw, read_tensor(scales, raw=True))


def layer_sources(ckpt: Checkpoint, layer: int) -> list[ExpertSource]:
    """Every expert of MoE layer `layer`, its tensors checked against config.json's shapes and the checkpoint's
    expert format (a mismatch is a one-line `CheckpointError` naming the tensor)."""
    cfg, fmt = ckpt.config, ckpt.expert_format
    e_num, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if ckpt.experts_transposed:  # gate_up [E, H, 2I], down [E, I, H] (strata.runtime.model.gpt_oss.layout)
        stem = f"model.layers.{layer}.mlp.experts."
        gu_shape, down_shape = transposed_shapes(cfg)
        gu, dn = _part(ckpt, fmt, stem + "gate_up_proj", gu_shape), _part(ckpt, fmt, stem + "down_proj", down_shape)
        return [ExpertSource(fmt, (_slice(gu, e, e_num),), _slice(dn, e, e_num), transposed=True) for e in range(e_num)]
    if ckpt.expert_layout == "fused":
        stem = f"model.layers.{layer}.mlp.experts."
        gu = _part(ckpt, fmt, stem + "gate_up_proj", (e_num, 2 * i, h))
        dn = _part(ckpt, fmt, stem + "down_proj", (e_num, h, i))
        return [ExpertSource(fmt, (_slice(gu, e, e_num),), _slice(dn, e, e_num)) for e in range(e_num)]
    out = []
    for e in range(e_num):
        names = ckpt.expert_names(layer, e)
        gate, up = (_part(ckpt, fmt, names[p], (i, h)) for p in ("gate_proj", "up_proj"))
        out.append(ExpertSource(fmt, (gate, up), _part(ckpt, fmt, names["down_proj"], (h, i))))
    return out


def _part(ckpt: Checkpoint, fmt: ExpertFormat, name: str, shape: tuple[int, ...]) -> Part:
    """The values and scales of weight `name` (a per-expert `...weight`, or a fused tensor's name) in
    `fmt`, checked to be `shape` [..., N, K] as config.json says."""
    index = ckpt.index
    if fmt.kind == "mxfp4":  # fused, or per expert (DeepSeek-V4's FP4 experts as `...weight_blocks`)
        values, scales = index[name + MX_BLOCKS], index[name + MX_SCALES]
        want = (*shape[:-1], shape[-1] // MX_GROUP, MX_GROUP // 2)
        ok = values.dtype == "U8" and values.shape == want and shape[-1] % MX_GROUP == 0
        expected = f"U8 {list(want)}"
    else:
        values = index[name]
        scales = index[name + FP8_SCALE] if fmt.kind == "fp8" else None
        dtype = "F8_E4M3" if fmt.kind == "fp8" else fmt.dtype
        # (an FP8 tensor's scales were checked against its shape when the checkpoint opened)
        ok, expected = values.dtype == dtype and values.shape == shape, f"{dtype} {list(shape)}"
    if not ok:
        raise CheckpointError(
            f"{values.file}: tensor {values.name!r} is {values.dtype} {list(values.shape)}, expected {expected} "
            f"from config.json and the checkpoint's {fmt.name} experts; the checkpoint and its config disagree")
    return values, scales


def _slice(part: Part, e: int, num: int) -> Part:
    """Expert `e`'s rows of a fused part [E, ...] (values and scales), as tensors of their own."""
    return tuple(None if t is None else TensorInfo(f"{t.name}[{e}]", t.file, t.offset + e * (t.nbytes // num),
                                                   t.nbytes // num, t.dtype, t.shape[1:]) for t in part)

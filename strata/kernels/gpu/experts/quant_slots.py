"""Quantized experts addressed by slot, and their dequantization to the compute dtype (prefill's scratch, fallbacks).

A slot of the GPU tier (or of pinned RAM) holds one expert's blob as `strata.kernels.quant.ExpertLayout` places it:
gate_up values, gate_up scales, down values, down scales, each section 256-byte aligned at the same offsets in every
slot. `QuantSlotWeights` is the quantized sibling of `strata.kernels.gpu.experts.grouped.SlotWeights`: the decode pair
kernels (`strata.kernels.gpu.experts.quant_pairs`) read its slots in their format; prefill dequantizes the slots a
grouped GEMM needs into a scratch buffer (`dequantize_slots`: one Triton launch per matrix on CUDA, torch elsewhere).
GGUF blobs (their header and ggml blocks, strata.kernels.quant) take the same paths through
`strata.kernels.gpu.experts.gguf_tiles` (bit for bit gguf's numpy dequantization).

Dequantizing rounds as `ExpertLayout.dequantize` does (w = values * scale in fp32, then one rounding to the
compute dtype), so a prefill on the scratch computes what a plain model of the dequantized weights computes.
(One exception no checkpoint meets: an MXFP4 scale byte of 0, 2**-127, reads as 0 here.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.gpu import pdl
from strata.kernels.gpu.experts import gguf_tiles
from strata.kernels.quant import E2M1, MX_GROUP, ExpertLayout, Section

try:  # Triton ships with CUDA builds of torch; CPU-only installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only hosts
    triton = None

FP8, MXFP4 = 0, 1  # the kernels' FMT constexpr
DEQUANT_BLOCK = (32, 128)  # (rows, columns) a dequantizing program writes


@dataclass(frozen=True)
class QuantSlotWeights:
    """Quantized experts addressed by slot: slab [S, slot_bytes] uint8 (rows contiguous), each slot one blob of
    `layout` (fp8, mxfp4 or gguf). What `SlotWeights` is for plain experts: the pair kernels and prefill take
    either."""

    slab: torch.Tensor
    layout: ExpertLayout

    def __post_init__(self) -> None:
        if not self.layout.fmt.quantized:
            raise ValueError("QuantSlotWeights holds fp8, mxfp4 or gguf experts; plain experts take SlotWeights")
        if self.slab.dtype != torch.uint8 or self.slab.dim() != 2 or self.slab.stride(1) != 1:
            raise ValueError("the slot slab must be a uint8 tensor [S, slot_bytes] with contiguous rows")
        if self.slab.shape[1] < self.layout.payload_bytes or self.slab.stride(0) % 16:
            raise ValueError(f"slots of {self.slab.shape[1]} bytes (stride {self.slab.stride(0)}) cannot hold "
                             f"{self.layout.fmt.name} blobs of {self.layout.payload_bytes} bytes at 16-byte alignment")

    @property
    def num_slots(self) -> int:
        return self.slab.shape[0]

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(gate_up [2I, H], down [H, I]): the experts' matrices as computed."""
        h, i = self.layout.hidden, self.layout.intermediate
        return (2 * i, h), (h, i)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts in `slots` [P] (int, valid slots, on the slab's device) dequantized to `dtype`: (gate_up
        [P, 2I, H], down [P, H, I]); no host synchronisation (`dequantize_slots`)."""
        return dequantize_slots(self, slots, dtype)

    def expert(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's expert in `dtype`: (gate_up [2I, H], down [H, I]) (a copy)."""
        gate_up, down = dequantize_slots(self, [slot], dtype)
        return gate_up[0], down[0]


def dequantize_blobs(blobs: torch.Tensor, layout: ExpertLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """blobs [P, B] uint8 (rows contiguous, B a multiple of 4), one expert's blob a row -> (gate_up [P, 2I, H],
    down [P, H, I]) in `dtype`: `layout.dequantize` of each row, batched (torch ops; no host synchronisation)."""
    if layout.fmt.kind == "gguf":
        return gguf_tiles.dequantize_gguf_blobs(blobs, layout, dtype)
    return (_dequantize_matrix(blobs, layout, layout.gate_up, layout.gate_up_scales, dtype),
            _dequantize_matrix(blobs, layout, layout.down, layout.down_scales, dtype))


def _section(blobs: torch.Tensor, s: Section) -> torch.Tensor:
    return blobs[:, s.offset : s.offset + s.nbytes].view(s.dtype).reshape(blobs.shape[0], *s.shape)


def _dequantize_matrix(blobs, layout: ExpertLayout, values: Section, scales: Section, dtype) -> torch.Tensor:
    v, s = _section(blobs, values), _section(blobs, scales)  # [P, N, K or K/2], [P, N/bn or N, K/bk or K/32]
    n = values.shape[0]
    if layout.fmt.kind == "fp8":
        bn, bk = layout.fmt.block
        k = values.shape[1]
        full = s.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]  # [P, N, K] fp32
        return (v.view(torch.float8_e4m3fn).float() * full).to(dtype)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blobs.device)
    codes = torch.stack((v & 0x0F, v >> 4), dim=-1).reshape(v.shape[0], n, -1, MX_GROUP).long()  # [P, N, K/32, 32]
    w = lut[codes] * torch.exp2(s.float() - 127.0)[..., None]
    return w.reshape(v.shape[0], n, -1).to(dtype)


def dequantize_slots(weights: QuantSlotWeights, slots: list[int] | torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts in `slots` dequantized into a scratch buffer: (gate_up [n, 2I, H], down [n, H, I]) in `dtype`,
    expert j from slots[j]. On CUDA one Triton launch a matrix (reads values + scales, writes `dtype`: no fp32
    temporaries; any fp8 block); elsewhere `dequantize_blobs`. Both round as `ExpertLayout.dequantize`."""
    slab = weights.slab
    if isinstance(slots, torch.Tensor):
        index = slots.to(slab.device, torch.int64)
    else:
        index = torch.tensor(slots, dtype=torch.int64).to(slab.device, non_blocking=True)
    if not (slab.is_cuda and triton is not None) or index.numel() == 0:
        return dequantize_blobs(slab.index_select(0, index), weights.layout, dtype)
    lay = weights.layout
    (gu_shape, dn_shape) = weights.shapes
    gu = torch.empty((index.numel(), *gu_shape), dtype=dtype, device=slab.device)
    dn = torch.empty((index.numel(), *dn_shape), dtype=dtype, device=slab.device)
    for out, values, scales in ((gu, lay.gate_up, lay.gate_up_scales), (dn, lay.down, lay.down_scales)):
        dequantize_into(slab, lay, index, values, scales, out)
    return gu, dn


def dequantize_into(slab: torch.Tensor, layout: ExpertLayout, index: torch.Tensor, values: Section, scales: Section,
                    out: torch.Tensor) -> None:
    """One matrix of the slots `index` [n] int64 of slab [S, slot_bytes] into out [n, N, K] (its dtype): the
    Triton dequantizer (CUDA, or Triton's interpreter on the CPU); gguf blobs: `gguf_tiles.dequantize_gguf_into`
    (`scales`, their header, is not read)."""
    if layout.fmt.kind == "gguf":
        gguf_tiles.dequantize_gguf_into(slab, layout, index, values, out)
        return
    n_rows, k = out.shape[1:]
    fmt = layout.fmt
    bn, group = (fmt.block if fmt.kind == "fp8" else (1, MX_GROUP))
    rows, cols = DEQUANT_BLOCK
    grid = (index.numel(), triton.cdiv(n_rows, rows), triton.cdiv(k, cols))
    _dequant_kernel[grid](slab, index, out, n_rows, k, slab.stride(0), values.offset, scales.offset, scales.shape[1],
                          out.stride(0), FMT=FP8 if fmt.kind == "fp8" else MXFP4, BN=bn, BK=group,
                          BLOCK_R=rows, BLOCK_C=cols, num_warps=4, **pdl.FP_FUSION)


if triton is not None:

    @triton.jit
    def e2m1_halves(b):
        """Packed MXFP4 bytes -> (low nibble's value, high nibble's value) fp32, each / 2**14: the 3 magnitude bits
        go where an fp16's exponent and mantissa end (e2m1's subnormal lands on fp16's), the sign on fp16's."""
        lo = (b & 0xF).to(tl.uint16)
        hi = (b >> 4).to(tl.uint16)
        lo = (((lo & 8) << 12) | ((lo & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((hi & 8) << 12) | ((hi & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def e8m0_scale(s):
        """e8m0 scale bytes -> 2**(s - 127) fp32, built from the exponent bits (exact; the byte 0 reads as 0)."""
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant_kernel(slab_ptr, index_ptr, out_ptr, N, K, stride_slot, val_off, scale_off, SK, stride_out,
                        FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        base = slab_ptr + tl.load(index_ptr + e) * stride_slot
        out = out_ptr + e.to(tl.int64) * stride_out
        mask_r = rows < N
        if FMT == 0:  # fp8: byte (r, c) at r * K + c, scale (r // BN, c // BK) fp32
            cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
            m = mask_r[:, None] & (cols < K)[None, :]
            q = tl.load(base + val_off + rows[:, None] * K + cols[None, :], mask=m, other=0)
            sp = (base + scale_off).to(tl.pointer_type(tl.float32), bitcast=True)
            s = tl.load(sp + (rows // BN)[:, None] * SK + (cols // BK)[None, :], mask=m, other=0.0)
            w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        else:  # mxfp4: byte (r, j) at r * K/2 + j holds columns 2j (low) and 2j + 1 (high); scale (r, 2j // 32)
            half = tl.program_id(2) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
            m = mask_r[:, None] & (half < K // 2)[None, :]
            b = tl.load(base + val_off + rows[:, None] * (K // 2) + half[None, :], mask=m, other=0)
            s = e8m0_scale(tl.load(base + scale_off + rows[:, None] * SK + (half // (BK // 2))[None, :], mask=m,
                                   other=0)) * 16384.0
            lo, hi = e2m1_halves(b)
            w = tl.reshape(tl.join(lo * s, hi * s), [BLOCK_R, BLOCK_C])  # columns 2j, 2j + 1 interleaved
            cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
            m = mask_r[:, None] & (cols < K)[None, :]
        tl.store(out + rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=m)

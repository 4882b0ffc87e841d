"""Expert weight formats: the dtype a checkpoint ships (bf16, f16, f32), block-scaled FP8 and MXFP4.

An expert is two matrices, gate_up [2I, H] (gate rows, then up rows) and down [H, I]. A quantized matrix
[N, K] is two tensors:

    fp8    values  [N, K] float8_e4m3fn (stored as uint8 bits); scale_inv [ceil(N/bn), ceil(K/bk)] float32,
           one per bn x bk block: w = values * scale_inv (DeepSeek-V3's `weight_scale_inv`)
    mxfp4  values  [N, K/2] uint8, two e2m1 codes a byte (element 2j in the low nibble, 2j+1 in the high,
           as gpt-oss's `*_blocks` [N, K/32, 16] flattened); scales [N, K/32] uint8 e8m0 (exponent + 127),
           one per 32 values along K: w = E2M1[code] * 2**(scale - 127) (OCP microscaling)

`ExpertLayout` places one expert's tensors in a blob: gate_up values, gate_up scales, down values, down
scales, each section starting 256-byte aligned, so a blob is still one read and one copy, and GPU and CPU
kernels read values and scales straight from the blob without a bf16 copy.

GGUF experts (kind "gguf", strata.kernels.gguf_blocks) keep the file's ggml blocks: a blob starts with a 3-byte
header, the block type ids of its gate, up and down tensors (a file mixes types per tensor and per layer, as
Q4_K_M does), then gate_up's section (gate's [I, H/bv * bb] blocks, then up's, two equal halves sized for the
widest type either holds) and down's [H, I/bv * bb]; the header is both matrices' "scales". Quantizing rounds to nearest
(ties to even); `dequantize_*` are the exact inverse on the grid, the oracle every kernel is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PLAIN_DTYPES: dict[str, torch.dtype] = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
QUANT_KINDS = ("fp8", "mxfp4", "gguf")
SECTION_ALIGN = 256  # bytes; every section of a blob starts at a multiple (vector loads, TMA)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MX_GROUP = 32  # values per e8m0 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class ExpertFormat:
    """How an expert's weights are stored: `kind` "plain" (in `dtype`), "fp8" (block `block`) or "mxfp4".

    `dtype` is the safetensors spelling of a plain format's dtype; quantized formats ignore it."""

    kind: str = "plain"
    dtype: str = "BF16"
    block: tuple[int, int] = (128, 128)  # fp8's (rows, cols) per scale
    ggml: tuple[tuple[str, ...], ...] = ()  # gguf's block types present for gate, up and down: three tuples

    def __post_init__(self) -> None:
        if self.kind not in ("plain", *QUANT_KINDS):
            raise ValueError(f"expert format {self.kind!r} is not one of plain, {', '.join(QUANT_KINDS)}")
        if self.kind == "plain" and self.dtype not in PLAIN_DTYPES:
            raise ValueError(f"expert dtype {self.dtype!r} is not one of {', '.join(PLAIN_DTYPES)}")
        if self.kind == "fp8" and not (len(self.block) == 2 and all(isinstance(b, int) and b > 0 for b in self.block)):
            raise ValueError(f"fp8 block {self.block!r} must be two positive integers")
        if self.kind == "gguf":
            from strata.kernels.gguf_blocks import BLOCK_TYPES

            if len(self.ggml) != 3 or not all(t and all(n in BLOCK_TYPES for n in t) for t in self.ggml):
                raise ValueError(f"gguf expert types {self.ggml!r} must be three lists of {', '.join(BLOCK_TYPES)}")

    @property
    def quantized(self) -> bool:
        return self.kind != "plain"

    @property
    def name(self) -> str:
        """What `strata inspect` and `plan` print: "bf16", "fp8 128x128", "mxfp4", "gguf Q4_K/Q6_K"."""
        if self.kind == "plain":
            return self.dtype.lower()
        if self.kind == "gguf":
            return "gguf " + "/".join(dict.fromkeys(n for t in self.ggml for n in t))
        return f"fp8 {self.block[0]}x{self.block[1]}" if self.kind == "fp8" else "mxfp4"

    def to_dict(self) -> dict:
        d: dict = {"kind": self.kind}
        if self.kind == "plain":
            d["dtype"] = self.dtype
        elif self.kind == "fp8":
            d["block"] = list(self.block)
        elif self.kind == "gguf":
            d["ggml"] = [list(t) for t in self.ggml]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ExpertFormat:
        kind = d.get("kind", "plain")
        return cls(kind=kind, dtype=d.get("dtype", "BF16"), block=tuple(d.get("block", (128, 128))),
                   ggml=tuple(tuple(t) for t in d.get("ggml", ())))


@dataclass(frozen=True)
class Section:
    """One tensor of a blob: `shape` elements of `dtype` at byte `offset`."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """This section of a 1-D uint8 blob buffer (any device) as a typed view; no copy."""
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class QuantMatrix:
    """A matrix [N, K] as stored: plain `values` (scales None), or quantized values and scales (see module)."""

    kind: str
    values: torch.Tensor
    scales: torch.Tensor | None
    shape: tuple[int, int]
    block: tuple[int, int] = (128, 128)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix [N, K] in `dtype` (a copy; plain values are returned converted, or as they are)."""
        if self.kind == "plain":
            return self.values.to(dtype)
        if self.kind == "fp8":
            return dequantize_fp8(self.values, self.scales, self.block, dtype)
        if self.kind == "gguf":
            return dequantize_gguf(self.values, self.scales, self.shape, dtype)
        return dequantize_mxfp4(self.values, self.scales, dtype)


# The kernels that read experts straight from their slots (or host RAM), and the format kinds each reads. A path whose
# set lacks a format is not taken for it: the runtime dequantizes each such expert into a scratch of the compute dtype
# and runs the reference math instead, and `strata plan` names the fallback. A kernel's owner adds a kind here once
# that kernel reads it (tested against `dequantize`).
FAST_PATHS: dict[str, frozenset[str]] = {
    "gpu_pairs": frozenset({"plain", "fp8", "mxfp4", "gguf"}),  # decode pair kernels over GPU slots, full-graph decode (strata.kernels.gpu.experts.grouped)
    "gpu_in_place": frozenset({"plain", "fp8", "mxfp4", "gguf"}),  # the GPU's in-place reads of pinned RAM in one-graph split decode
    "gpu_grouped": frozenset({"plain", "fp8", "mxfp4", "gguf"}),  # prefill's grouped GEMMs over GPU slots (strata.kernels.gpu.experts.grouped_gemm)
    "cpu_kernel": frozenset({"plain", "fp8", "mxfp4", "gguf"}),  # the compiled CPU expert kernel (strata.kernels.cpu)
    "cpu_mailbox": frozenset({"plain", "fp8", "mxfp4", "gguf"}),  # one-graph decode's native CPU worker (strata.runtime.offload.mailbox)
}
_GGUF_KERNEL_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS"})
GGUF_FAST_TYPES: dict[str, frozenset[str]] = {
    "cpu_kernel": _GGUF_KERNEL_TYPES, "cpu_mailbox": _GGUF_KERNEL_TYPES,
    "gpu_pairs": _GGUF_KERNEL_TYPES, "gpu_in_place": _GGUF_KERNEL_TYPES, "gpu_grouped": _GGUF_KERNEL_TYPES,
}
"""The ggml block types a path with "gguf" reads: it reads a GGUF format only if every matrix's types are here."""
FP8_BLOCKS = (128, 64, 32, 16)  # the square fp8 blocks `fp8_block_for` picks from, largest first


def reads(path: str, fmt: ExpertFormat) -> bool:
    """Whether fast path `path` (a key of `FAST_PATHS`) reads experts stored in `fmt` in place."""
    types = GGUF_FAST_TYPES.get(path, frozenset())
    return fmt.kind in FAST_PATHS[path] and (fmt.kind != "gguf" or all(n in types for t in fmt.ggml for n in t))


def fp8_block_for(intermediate: int) -> tuple[int, int]:
    """The fp8 block a bf16 checkpoint's experts are quantized with: the largest square of `FP8_BLOCKS` whose side
    divides the intermediate size (128 x 128, as model makers ship, whenever it does); `ValueError` when none does."""
    for b in FP8_BLOCKS:
        if intermediate % b == 0:
            return (b, b)
    raise ValueError(f"fp8 experts need an intermediate size ({intermediate}) that is a multiple of 16; "
                     "keep this model's experts as they are")


def check_shapes(fmt: ExpertFormat, hidden: int, intermediate: int) -> None:
    """`ValueError` naming the fix when an expert of hidden H and intermediate I cannot take `fmt`."""
    if fmt.kind == "fp8" and intermediate % fmt.block[0]:
        raise ValueError(f"fp8 experts need the intermediate size ({intermediate}) to be a multiple of the block's "
                         f"rows ({fmt.block[0]}), so gate and up scales stack; choose a block that divides it")
    if fmt.kind == "mxfp4" and (hidden % MX_GROUP or intermediate % MX_GROUP):
        raise ValueError(f"mxfp4 experts need hidden ({hidden}) and intermediate ({intermediate}) sizes that are "
                         f"multiples of {MX_GROUP}; use fp8 for this model")
    if fmt.kind == "gguf":
        from strata.kernels.gguf_blocks import BLOCK_TYPES

        for types, k, what in ((fmt.ggml[0] + fmt.ggml[1], hidden, "hidden"), (fmt.ggml[2], intermediate, "intermediate")):
            for n in types:
                if k % BLOCK_TYPES[n].block_values:
                    raise ValueError(f"{n} experts need the {what} size ({k}) to be a multiple of "
                                     f"{BLOCK_TYPES[n].block_values}; this model cannot keep them in {n}")


def _matrix_sections(fmt: ExpertFormat, n: int, k: int, offset: int) -> tuple[Section, Section | None, int]:
    """(values, scales, end offset) of a matrix [n, k] placed at `offset` (256-aligned sections)."""
    if fmt.kind == "plain":
        values = Section(offset, (n, k), PLAIN_DTYPES[fmt.dtype])
        return values, None, offset + values.nbytes
    if fmt.kind == "fp8":
        values = Section(offset, (n, k), torch.uint8)
        bn, bk = fmt.block
        scales = Section(_align(offset + values.nbytes), (-(-n // bn), -(-k // bk)), torch.float32)
    else:
        values = Section(offset, (n, k // 2), torch.uint8)
        scales = Section(_align(offset + values.nbytes), (n, k // MX_GROUP), torch.uint8)
    return values, scales, scales.offset + scales.nbytes


def _gguf_sections(fmt: ExpertFormat, h: int, i: int) -> tuple[Section, Section, Section, Section, int]:
    """(gate_up, header [gate, up types], down, header [down type], payload) of a gguf blob (see module)."""
    from strata.kernels.gguf_blocks import BLOCK_TYPES

    def widest(types: tuple[str, ...], rows: int, k: int) -> int:
        return rows * max(BLOCK_TYPES[n].row_bytes(k) for n in types)

    # two equal halves (the gate's, then the up's), each as wide as the widest type of either: readers find up's rows
    # at the section's middle whichever types the two tensors have
    gu_bytes = 2 * max(widest(fmt.ggml[0], i, h), widest(fmt.ggml[1], i, h))
    gate_up = Section(SECTION_ALIGN, (gu_bytes,), torch.uint8)
    down = Section(_align(SECTION_ALIGN + gu_bytes), (widest(fmt.ggml[2], h, i),), torch.uint8)
    return gate_up, Section(0, (2,), torch.uint8), down, Section(2, (1,), torch.uint8), down.offset + down.nbytes


def gguf_half_bytes(section_bytes: int, parts: int) -> int:
    """Bytes each of a gguf section's `parts` tensors may take (gate_up: 2 halves, down: 1)."""
    return section_bytes // parts


def dequantize_gguf(values: torch.Tensor, types: torch.Tensor, shape: tuple[int, int],
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A gguf section (1-D uint8) and its type ids (2 for gate_up: gate rows then up rows; 1 for down) -> w [N, K],
    dequantized on the section's device by torch (`gguf_blocks.dequantize_rows`; only the type ids are read back)."""
    from strata.kernels.gguf_blocks import dequantize_rows

    n, k = shape
    ids = types.tolist()
    rows, half = n // len(ids), gguf_half_bytes(values.numel(), len(ids))
    parts = [dequantize_rows(values[j * half : (j + 1) * half], t, rows, k) for j, t in enumerate(ids)]
    return torch.cat(parts).to(dtype)


def _align(n: int) -> int:
    return -(-n // SECTION_ALIGN) * SECTION_ALIGN


@dataclass(frozen=True)
class ExpertLayout:
    """Where one expert's tensors sit in its blob, for `fmt` and an expert of hidden H, intermediate I.

    Plain formats keep the historical layout (gate_up then down, back to back); quantized ones have four
    256-aligned sections. `payload_bytes` is the blob's length before padding to its slot."""

    fmt: ExpertFormat
    hidden: int
    intermediate: int
    gate_up: Section
    gate_up_scales: Section | None
    down: Section
    down_scales: Section | None
    payload_bytes: int

    @classmethod
    def build(cls, fmt: ExpertFormat, hidden: int, intermediate: int) -> ExpertLayout:
        check_shapes(fmt, hidden, intermediate)
        if fmt.kind == "gguf":
            return cls(fmt, hidden, intermediate, *_gguf_sections(fmt, hidden, intermediate))
        gu, gus, end = _matrix_sections(fmt, 2 * intermediate, hidden, 0)
        start = end if fmt.kind == "plain" else _align(end)
        dn, dns, end = _matrix_sections(fmt, hidden, intermediate, start)
        return cls(fmt, hidden, intermediate, gu, gus, dn, dns, end)

    @property
    def gate_up_bytes(self) -> int:
        """Bytes from the blob's start to the end of gate_up's sections (a kernel's first half to read)."""
        return self.down.offset

    def matrices(self, buf: torch.Tensor) -> tuple[QuantMatrix, QuantMatrix]:
        """(gate_up, down) of a 1-D uint8 blob buffer on any device, as views; no copy."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.payload_bytes:
            raise ValueError(f"buf must be a 1-D uint8 tensor of at least {self.payload_bytes} bytes")
        h, i, kind, block = self.hidden, self.intermediate, self.fmt.kind, self.fmt.block

        def matrix(values: Section, scales: Section | None, shape: tuple[int, int]) -> QuantMatrix:
            return QuantMatrix(kind, values.view(buf), scales.view(buf) if scales else None, shape, block)

        return (matrix(self.gate_up, self.gate_up_scales, (2 * i, h)), matrix(self.down, self.down_scales, (h, i)))

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize (round to nearest) or convert gate_up [2I, H] and down [H, I] into a blob: a CPU uint8
        tensor of `payload_bytes` (or `out`, at least that long; bytes between sections are zeroed)."""
        if self.fmt.kind == "gguf":
            raise ValueError("strata does not quantize experts to GGUF block types; convert a GGUF file that has them")
        if out is None:
            out = torch.zeros(self.payload_bytes, dtype=torch.uint8)
        else:
            out[: self.payload_bytes].zero_()
        h, i = self.hidden, self.intermediate
        for w, values, scales, shape in ((gate_up, self.gate_up, self.gate_up_scales, (2 * i, h)),
                                         (down, self.down, self.down_scales, (h, i))):
            if tuple(w.shape) != shape:
                raise ValueError(f"expert matrix of shape {tuple(w.shape)} is not the expert's {shape}")
            if self.fmt.kind == "plain":
                values.view(out).copy_(w)
                continue
            q, s = quantize_fp8(w, self.fmt.block) if self.fmt.kind == "fp8" else quantize_mxfp4(w)
            values.view(out).copy_(q.view(torch.uint8) if q.dtype != torch.uint8 else q)
            scales.view(out).copy_(s)
        return out

    def pack_quantized(self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """A blob from tensors already in this format, as a checkpoint ships them: (values, scales) per matrix
        (fp8 values as float8_e4m3fn or uint8 bits; mxfp4 values [N, K/2] or [N, K/32, 16])."""
        if out is None:
            out = torch.zeros(self.payload_bytes, dtype=torch.uint8)
        for (q, s), values, scales in ((gate_up, self.gate_up, self.gate_up_scales), (down, self.down, self.down_scales)):
            q = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
            if q.numel() != math.prod(values.shape) or s.numel() != math.prod(scales.shape):
                raise ValueError(f"quantized tensors {tuple(q.shape)} / {tuple(s.shape)} do not fit "
                                 f"{self.fmt.name} sections {values.shape} / {scales.shape}")
            values.view(out).copy_(q.reshape(values.shape))
            scales.view(out).copy_(s.reshape(scales.shape).to(scales.dtype))
        return out

    def pack_gguf(self, gate: tuple[str, torch.Tensor], up: tuple[str, torch.Tensor], down: tuple[str, torch.Tensor],
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """A gguf blob from one expert's tensors as the file ships them: (type name, uint8 blocks [rows, row_bytes])."""
        from strata.kernels.gguf_blocks import BLOCK_TYPES

        if out is None:
            out = torch.zeros(self.payload_bytes, dtype=torch.uint8)
        else:
            out[: self.payload_bytes].zero_()
        h, i = self.hidden, self.intermediate
        half = gguf_half_bytes(self.gate_up.nbytes, 2)
        for j, ((name, raw), k, section, at) in enumerate(((gate, h, self.gate_up, 0), (up, h, self.gate_up, half),
                                                          (down, i, self.down, 0))):
            t = BLOCK_TYPES[name]
            if name not in self.fmt.ggml[j] or raw.numel() != (i if j < 2 else h) * t.row_bytes(k):
                raise ValueError(f"{name} blocks of {raw.numel()} bytes do not fit {self.fmt.name} expert "
                                 f"{('gate', 'up', 'down')[j]} of {h} x {i}")
            start = section.offset + at
            out[start : start + raw.numel()].copy_(raw.reshape(-1))
            out[j] = t.ggml_id
        return out

    def dequantize(self, buf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of a blob in `dtype`: the reference every kernel is checked against."""
        gate_up, down = self.matrices(buf)
        return gate_up.dequantize(dtype), down.dequantize(dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (values [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32), one scale per
    block: scale_inv = amax / 448 (1 for an all-zero block), values = round(w / scale_inv)."""
    n, k = w.shape
    bn, bk = block
    scale = _block_amax(w.float(), bn, bk) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    values = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def dequantize_fp8(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [N, K] (float8_e4m3fn or its uint8 bits), scale_inv [ceil(N/bn), ceil(K/bk)] -> w [N, K]."""
    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    n, k = values.shape
    bn, bk = block
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (values.float() * full).to(dtype)


def _block_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w.abs()
    return padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (values [N, K/2] uint8, scales [N, K/32] uint8 e8m0).

    Each group of 32 takes the smallest power of two 2**e with amax / 2**e <= 6 (e clamped to [-127, 127]);
    values round to the nearest e2m1 code, ties to the even code."""
    n, k = w.shape
    if k % MX_GROUP:
        raise ValueError(f"mxfp4 needs a multiple of {MX_GROUP} columns, not {k}")
    groups = w.float().reshape(n, k // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).to(torch.int32)
    scaled = groups / torch.exp2(exp.float())[..., None]
    mag = scaled.abs()
    # the code is the number of midpoints below the magnitude; a tie goes to the even code: strictly above the
    # midpoints after an even code (i even), at or above those after an odd one (one uint8 pass each: torch's
    # bucketize works in int64 and took 12x as long)
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=w.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        code += (mag >= mid) if i % 2 else (mag > mid)
    code.masked_fill_(mag.isnan(), len(_E2M1_MIDPOINTS))  # (as bucketize places NaN: past every midpoint)
    code |= ((scaled < 0) & (code > 0)).to(torch.uint8) << 3  # -0.0 is stored as +0
    code = code.reshape(n, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)


def dequantize_mxfp4(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [N, K/2] (or gpt-oss's [N, K/32, 16]) uint8, scales [N, K/32] uint8 -> w [N, K]."""
    n = scales.shape[0]
    packed = values.reshape(n, -1)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=values.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, -1).long()
    w = lut[codes].reshape(n, -1, MX_GROUP)
    w = w * torch.exp2(scales.reshape(n, -1).float() - 127.0)[..., None]
    return w.reshape(n, -1).to(dtype)

"""Slot-indexed expert compute for small batches (decode): one launch per projection for all pairs.

A decode step routes N tokens to k experts each: P = N*k (token, expert) pairs. Pair p runs the expert
whose weights sit in slot `slot_of[ids[p]]` of a slot buffer on token `p // k` and writes its output
row `y[p]` [H] fp32. The slot buffer is the GPU tier's slab (a strided view over fixed-size slots) or
the stacked all-in-memory experts (slot = expert id), so the same kernels serve both.

The slot lookup happens inside the kernel (`slot_of` is a device table), so there is no host round
trip and a decode step can be captured in a CUDA graph. Pairs whose expert is not resident (slot -1)
are skipped; the cold path fills their rows. A map update enqueued on the same stream is seen either
before the lookup (the pair is skipped) or after the kernel (the copy that reuses the slot waits for
it): the gate/up kernel records the slot it used and the down kernel reads that record, so both
projections always use one consistent slot.

Triton kernels on CUDA (strata.kernels.gpu.experts.plain_pairs); a pure-torch fallback (gather + bmm) elsewhere, with
the same results to rounding. Every path computes any `SwiGLUForm` (DeepSeek-V4's clipped SwiGLU, gpt-oss's clamped,
offset, interleaved one) and adds an optional per-expert gate_up bias [E, 2I] before the activation
(strata.kernels.gpu.experts.pair_forms); the down bias is not theirs (strata.kernels.experts.down_bias_term adds it
once).

Expert formats (strata.kernels.quant): plain experts are `SlotWeights` (typed views of the slots); FP8, MXFP4 and
GGUF experts are `QuantSlotWeights` (the slab and the blob's `ExpertLayout`) and in pinned RAM `HostExperts` with a
layout. Every entry point here takes either and picks the path in one place, `fast_path`: the quantized pair and
in-place kernels (strata.kernels.gpu.experts.quant_pairs) read the blob in its format and dequantize in registers;
prefill dequantizes per expert into a scratch buffer for the grouped GEMM (strata.kernels.gpu.experts.grouped_gemm).
`formats_supported()` lists the format kinds these kernels read and `fast_path_refusal(fmt)` says why a format has
no kernel (an fp8 block not a power of two wide: its pairs then gather their experts dequantized and run the torch
path, and no in-place share is made). The runtime and the planner take the GPU paths for the kinds the GPU entries of
strata.kernels.quant.FAST_PATHS list, which may hold only kinds of `formats_supported()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.gpu import fused, pdl
from strata.kernels.gpu.experts import pair_forms, quant_pairs
from strata.kernels.gpu.experts.pair_forms import triton
from strata.kernels.gpu.experts.plain_pairs import _down_kernel, _gate_up_kernel
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
from strata.kernels.quant import PLAIN_DTYPES, ExpertFormat, ExpertLayout

PAIR_LIMIT = 128  # pairs per step up to which the pair kernels beat grouping tokens by expert
# The pair kernels' launch configurations: gate/up (BLOCK_I, BLOCK_H, warps, stages), down (BLOCK_O, BLOCK_I,
# warps, stages). Few pairs need smaller blocks, hence more programs in flight, to keep enough memory reads
# outstanding. Measured on the H200 (bench/probes/pair_kernel_probe.py sweeps them). A configuration fixes each output's
# summation order, so the in-memory and tiered engines, which pick it by the same pair count, agree bit for bit.
PAIR_CONFIGS = {"small": ((4, 2048, 4, 3), (8, 256, 2, 3)), "large": ((4, 1024, 4, 3), (8, 256, 2, 3))}
SMALL_PAIRS = 16
IN_PLACE_BLOCKS = (8, 512, 16, 256)  # pair_experts_in_place (reads over PCIe, ~50 GB/s: the link, not the tiles, bounds it)


def formats_supported() -> set[str]:
    """The expert format kinds ("plain", "fp8", "mxfp4", "gguf") the GPU computes in their own format: decode pair
    kernels and in-place reads without a bf16 copy, prefill through a per-expert dequantized scratch. Quantized
    kinds need Triton; an fp8 block must also be a power of two wide, gguf blocks of the types
    strata.kernels.gpu.experts.gguf_pairs reads (`fast_path_refusal`). The kinds the runtime may list in
    strata.kernels.quant.FAST_PATHS' GPU entries."""
    return {"plain"} | ({"fp8", "mxfp4", "gguf"} if triton is not None else set())


def fast_path_refusal(fmt: ExpertFormat) -> str | None:
    """None when experts of `fmt` have the GPU path of `formats_supported`, else why not, in one line (decode then
    dequantizes each step's experts with torch and reads nothing in place)."""
    return None if fmt.kind == "plain" else quant_pairs.kernel_refusal(fmt)


def fast_path(weights) -> str:
    """Which path a call over `weights` (SlotWeights, QuantSlotWeights or HostExperts) takes on CUDA: "plain" (the
    bf16 kernels), "quant" (the quantized kernels) or "torch" (gather, dequantize, bmm)."""
    layout = weights.layout
    if layout is None or not layout.fmt.quantized:
        return "plain" if triton is not None else "torch"
    return "quant" if fast_path_refusal(layout.fmt) is None else "torch"


def pair_config(num_pairs: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The (gate/up, down) launch configuration for a call of `num_pairs` pairs (`PAIR_CONFIGS`)."""
    return PAIR_CONFIGS["small" if num_pairs <= SMALL_PAIRS else "large"]


@dataclass(frozen=True)
class SlotWeights:
    """Expert weights addressed by slot: gate_up [S, 2I, H], down [S, H, I] (strided views allowed)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    layout = None  # plain weights (QuantSlotWeights carries its blob's layout)

    def __post_init__(self) -> None:
        s, two_i, h = self.gate_up.shape
        if self.down.shape != (s, h, two_i // 2):
            raise ValueError(f"down {tuple(self.down.shape)} does not match gate_up {tuple(self.gate_up.shape)}")
        if self.gate_up.stride(-1) != 1 or self.down.stride(-1) != 1:
            raise ValueError("expert rows must be contiguous (last stride 1)")

    @staticmethod
    def from_slab(slab: torch.Tensor, dtype: torch.dtype, gate_up_shape: tuple[int, int],
                  down_shape: tuple[int, int], down_offset: int) -> SlotWeights:
        """Typed views over a uint8 slab [S, slot_bytes] whose slots hold gate_up then down at `down_offset` bytes."""
        size = torch.empty((), dtype=dtype).element_size()
        if slab.shape[1] % size or down_offset % size:
            raise ValueError("slot size and down offset must be multiples of the element size")
        typed = slab.view(dtype)  # [S, slot_bytes / size]
        (a, b), (c, d) = gate_up_shape, down_shape
        off = down_offset // size
        return SlotWeights(typed[:, : a * b].view(-1, a, b), typed[:, off : off + c * d].view(-1, c, d))

    @property
    def num_slots(self) -> int:
        return self.gate_up.shape[0]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts in `slots` [P]: (gate_up [P, 2I, H], down [P, H, I]) in their own dtype (`dtype` is what
        a quantized sibling dequantizes to)."""
        return self.gate_up[slots], self.down[slots]

    def expert(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's expert in `dtype`: (gate_up [2I, H], down [H, I])."""
        return self.gate_up[slot].to(dtype), self.down[slot].to(dtype)


def slot_weights(slab: torch.Tensor, layout: ExpertLayout) -> SlotWeights | QuantSlotWeights:
    """The slots of a uint8 slab [S, slot_bytes], each holding one blob of `layout`, as the pair kernels and prefill
    take them: typed views for a plain format, the slab itself for fp8 and mxfp4."""
    if layout.fmt.quantized:
        return QuantSlotWeights(slab, layout)
    return SlotWeights.from_slab(slab, PLAIN_DTYPES[layout.fmt.dtype], (2 * layout.intermediate, layout.hidden),
                                 (layout.hidden, layout.intermediate), layout.down.offset)


@dataclass(frozen=True)
class HostExperts:
    """How an expert lies in a page-locked host slot (the store's slot layout): gate_up [2I, H], then down
    [H, I] at `down_offset` bytes, both `dtype`; or, with a quantized `layout`, its blob (`of_layout`).
    `pair_experts_in_place` reads such slots by address."""

    dtype: torch.dtype
    gate_up_shape: tuple[int, int]
    down_shape: tuple[int, int]
    down_offset: int
    layout: ExpertLayout | None = None

    @staticmethod
    def of_layout(layout: ExpertLayout) -> HostExperts:
        """Slots holding one blob of `layout` each (plain: typed gate_up then down; fp8, mxfp4: in their format)."""
        h, i = layout.hidden, layout.intermediate
        dtype = PLAIN_DTYPES[layout.fmt.dtype] if not layout.fmt.quantized else torch.uint8
        return HostExperts(dtype, (2 * i, h), (h, i), layout.down.offset, layout if layout.fmt.quantized else None)

    def typed(self, device: torch.device) -> torch.Tensor:
        """A one-element tensor of `dtype` on `device` (the kernels take their pointer type from it)."""
        key = (str(device), self.dtype)
        if key not in _TYPED:
            _TYPED[key] = torch.zeros(1, dtype=self.dtype, device=device)
        return _TYPED[key]


_TYPED: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def use_pair_kernels(x: torch.Tensor, num_pairs: int) -> bool:
    """Whether a step of `num_pairs` pairs takes the pair kernels (GPU, small batches) or per-expert groups."""
    return x.is_cuda and num_pairs <= PAIR_LIMIT


def pair_experts(x: torch.Tensor, weights: SlotWeights | QuantSlotWeights, slot_of: torch.Tensor, ids: torch.Tensor,
                 y: torch.Tensor, rows: torch.Tensor | None = None, used: torch.Tensor | None = None,
                 form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Run pair p = expert `ids[p]` (looked up in `slot_of` [E] int32, -1 = skip) on token `rows[p] // k`.

    x [N, H]; ids [P] int; y [N*k, H] fp32 receives row `rows[p]` (default p, with k = y.shape[0] // N).
    `used` [P] int32 receives the slot each pair used (-1: skipped). Returns `used`. Quantized slots compute as
    their dequantized weights in x's dtype would (`ExpertLayout.dequantize`), to rounding.
    `form`: the SwiGLU between the two projections; `gate_up_bias` [E, 2I] (any float dtype, read as fp32, in
    gate_up's row order): row ids[p] added to pair p's gate/up products before it (where ids are pair indices
    into a per-pair slot table, pass the pairs' rows, bias[expert of p] [P, 2I]). The down bias is not added.
    """
    p = ids.numel()
    k = y.shape[0] // x.shape[0]
    used = torch.empty(p, dtype=torch.int32, device=x.device) if used is None else used
    if p == 0:
        return used
    if gate_up_bias is not None:
        pair_forms.check_bias(gate_up_bias, weights.layout.intermediate if weights.layout is not None
                                 else weights.down.shape[-1])
    path = fast_path(weights) if x.is_cuda else "torch"
    if path == "plain":  # ids of any integer dtype; no rows: row p (no arange launched)
        _pair_triton(x, weights, slot_of, ids, rows, k, y, used, form, gate_up_bias)
    elif path == "quant":
        quant_pairs.pair_quant(x, weights, slot_of, ids, rows, k, y, used, form=form, gate_up_bias=gate_up_bias)
    else:
        rows = torch.arange(p, device=x.device, dtype=torch.int32) if rows is None else rows.to(torch.int32)
        _pair_torch(x, weights, slot_of, ids, rows, k, y, used, form, gate_up_bias)
    return used


def combine_pairs(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                  extra: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs, plus `extra` (the CPU's partial sum), cast to `dtype`, plus
    `residual` (the layer's input: `x + mlp(h)` in the same launch): y [N*k, H] fp32, weights [N, k], extra [N, H]
    fp32, residual [N, H] -> [N, H]. One fused kernel on CUDA.

    Always the same order whatever computed each row, so tiers never change the result."""
    fold = residual if fused.FOLDS and fused.RESIDUAL_FOLD else None
    fused_out = fused.combine(y, weights, dtype, extra, fold)
    if fused_out is not None:
        return fused_out if fold is not None or residual is None else residual + fused_out
    n, k = weights.shape
    out = (y.view(n, k, -1) * weights.float()[..., None]).sum(dim=1)
    out = (out if extra is None else out + extra).to(dtype)
    return out if residual is None else residual + out


def _pair_torch(x, weights: SlotWeights | QuantSlotWeights, slot_of, ids, rows, k, y, used,
                form: SwiGLUForm = PLAIN_SWIGLU, gate_up_bias: torch.Tensor | None = None) -> None:
    """Fallback: gather each pair's expert (quantized ones dequantized to x's dtype) and run it with batched
    matmuls (no host sync on CUDA): `pair_experts`' arguments, rows [P] int32."""
    slots = slot_of[ids.long()].to(torch.int32)
    used.copy_(slots)
    ok = (slots >= 0)
    s = slots.clamp(min=0).long()
    tok = rows.long() // k
    gate_up, down = weights.gather(s, x.dtype)  # [P, 2I, H], [P, H, I]
    xs = x[tok].to(gate_up.dtype)  # [P, H]
    gu = torch.bmm(gate_up, xs[:, :, None])[..., 0].float()  # [P, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias[ids.long()].float()  # [P, 2I]: each pair's expert's row
    h = form.apply(gu).to(down.dtype)  # [P, I]
    out = torch.bmm(down, h[:, :, None])[..., 0].float()  # [P, H]
    out = torch.where(ok[:, None], out, y[rows.long()])
    y.index_copy_(0, rows.long(), out)


def _pair_triton(x, weights: SlotWeights, slot_of, ids, rows, k, y, used, form: SwiGLUForm = PLAIN_SWIGLU,
                 gate_up_bias: torch.Tensor | None = None) -> None:
    """`pair_experts`' Triton path for plain slots (same arguments; rows None: row p)."""
    gu, dn = weights.gate_up, weights.down
    _, two_i, hidden = gu.shape
    inter = two_i // 2
    p = ids.numel()
    x = x.contiguous()
    h = torch.empty((p, inter), dtype=torch.float32, device=x.device)  # SwiGLU(gate, up) per pair [P, I]
    (block_i, block_h, warps_gu, stages_gu), (block_o, block_k, warps_d, stages_d) = pair_config(p)
    has_rows = rows is not None
    rows = rows if has_rows else ids  # an unread pointer when HAS_ROWS is off
    _gate_up_kernel[(p, triton.cdiv(inter, block_i))](
        x, gu, slot_of, ids, rows, used, h, ids, hidden, inter, k, x.stride(0), gu.stride(0), gu.stride(1),
        h.stride(0), BLOCK_I=block_i, BLOCK_H=block_h, HAS_ROWS=has_rows, ADDR=False, FIRST=False,
        num_warps=warps_gu, num_stages=stages_gu, **pair_forms.kernel_args(form, gate_up_bias), **pdl.launch(x))
    _down_kernel[(p, triton.cdiv(hidden, block_o))](
        h, dn, used, rows, y, ids, ids, 0, hidden, inter, h.stride(0), dn.stride(0), dn.stride(1),
        y.stride(0), BLOCK_O=block_o, BLOCK_I=block_k, HAS_ROWS=has_rows, ADDR=False, FIRST=False,
        num_warps=warps_d, num_stages=stages_d, **pdl.launch(x))


def in_place_ok(experts: HostExperts | None = None) -> bool:
    """Whether `pair_experts_in_place` can run here (a CUDA GPU and Triton) on `experts` (None: plain ones)."""
    return triton is not None and torch.cuda.is_available() and (experts is None or fast_path(experts) != "torch")


def pair_experts_in_place(x: torch.Tensor, experts: HostExperts, addresses: torch.Tensor, y: torch.Tensor,
                          first_row: torch.Tensor | None = None, form: SwiGLUForm = PLAIN_SWIGLU,
                          gate_up_bias: torch.Tensor | None = None, expert_ids: torch.Tensor | None = None) -> None:
    """Pairs p with `addresses[p]` != 0 ([P] int64: the host address of its expert's page-locked slot) run
    on token p // k, their weights read in place from host RAM over PCIe (zero-copy: no staging copy, no
    GPU slot); y [P, H] fp32 receives their rows, the others are left as they are. CUDA with Triton only.
    first_row [P] int32: compute only the intermediate rows from first_row[p] on (the rest of an expert whose
    first rows another computes: y then holds that part's sum); None: every row. `form` and `gate_up_bias` [E, 2I]
    as in `pair_experts`; the bias row of pair p is expert_ids[p] ([P] int, required with a bias: the kernels
    know a pair's expert only by its address). With `form.interleaved`, intermediate row j is gate_up's rows
    2j (gate) and 2j + 1 (up), so first_row splits the interleaved rows the same way.

    For one decode token the GPU reads each weight once either way, so reading it where it lies costs the
    link's rate (~50 GB/s on the H200 box, bench/probes/zero_copy.py) and none of a copy's host bookkeeping."""
    if gate_up_bias is not None and expert_ids is None:
        raise ValueError("a gate_up bias read in place needs expert_ids (each pair's expert)")
    pair_forms.check_bias(gate_up_bias, experts.down_shape[1])
    if triton is None or not (x.is_cuda or fused._INTERPRET):
        raise RuntimeError("reading experts in place needs a CUDA GPU with Triton")
    p = addresses.numel()
    if p == 0:
        return
    if experts.layout is not None:  # fp8 / mxfp4 / gguf blobs, read in their format
        if fast_path(experts) != "quant":
            raise RuntimeError(f"{experts.layout.fmt.name} experts cannot be read in place: "
                               f"{fast_path_refusal(experts.layout.fmt)}")
        quant_pairs.pair_quant_in_place(x, experts.layout, addresses, y, first_row, form, gate_up_bias, expert_ids)
        return
    k = y.shape[0] // x.shape[0]
    (_, hidden), (_, inter) = experts.gate_up_shape, experts.down_shape
    x = x.contiguous()
    typed = experts.typed(x.device)  # the weights' element type for the kernels' pointers
    h = torch.empty((p, inter), dtype=torch.float32, device=x.device)
    used = torch.empty(p, dtype=torch.int32, device=x.device)
    block_i, block_h, block_o, block_k = IN_PLACE_BLOCKS
    first = first_row is not None
    first_row = first_row if first else addresses  # an unread pointer when FIRST is off
    _gate_up_kernel[(p, triton.cdiv(inter, block_i))](
        x, typed, addresses, addresses, addresses, used, h, first_row, hidden, inter, k, x.stride(0), 0, hidden,
        h.stride(0), BLOCK_I=block_i, BLOCK_H=block_h, HAS_ROWS=False, ADDR=True, FIRST=first, num_warps=4,
        **pair_forms.kernel_args(form, gate_up_bias, expert_ids), **pdl.launch(x))
    _down_kernel[(p, triton.cdiv(hidden, block_o))](
        h, typed, used, addresses, y, addresses, first_row, experts.down_offset, hidden, inter, h.stride(0), 0, inter,
        y.stride(0), BLOCK_O=block_o, BLOCK_I=block_k, HAS_ROWS=False, ADDR=True, FIRST=first, num_warps=4,
        **pdl.launch(x))

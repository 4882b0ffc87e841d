"""Cold experts on CPU threads: all the experts of one MoE layer in one threaded, vectorised call.

    out = cpu_experts_forward(x, [(gate_up, down), ...], token_idx, token_w, out=None, threads=None,
                              form=PLAIN_SWIGLU, gate_up_bias=None, expert_ids=None)

Each expert is a SwiGLU MLP, `down(silu(gate(x)) * up(x))`, or any `SwiGLUForm` (strata.kernels.experts: DeepSeek-V4's
clip, gpt-oss's clamped, scaled, offset SwiGLU on interleaved rows) with an optional gate_up bias per expert (a layer's
table [E, 2I], added before the form; the down bias is `down_bias_term`'s, outside), with its weights in their own
(pinned or host) buffers: gate_up [2I, H] (gate rows, then up rows, or interleaved) and down [H, I], as bf16 tensors
or as a pair of `QuantMatrix` (strata.kernels.quant) in block-scaled FP8, MXFP4 or GGUF (each matrix in its ggml block
type, on avx512_bf16), one format a call. The kernel reads a quantized expert as it is stored and converts it in
registers (no bf16 copy of it; `expert_args`), except a prompt-sized one where torch's GEMMs run on AMX
(`quant_max_tokens`): that one is dequantized to a bf16 scratch (strata.kernels.cpu.dequant) for the GEMMs. For the
few tokens of a decode step the work is memory-bound, so what counts is bytes of weights read per second: a C++
kernel (csrc/cpu_experts.cpp, built on first use) reads every weight row once for all of an expert's
tokens, splits the gate/up rows of all the layer's experts over a persistent thread pool (chunks taken
dynamically), then, once every gate/up chunk is done, the down rows (threads with no gate/up chunk left
claim down chunks and read them ahead; `tune`); one fork/join per layer, the GIL released while it runs,
software prefetch along the rows. `trace` times each call's phases (strata/kernels/cpu/tuning.py). A worker the
OS has not scheduled yet holds no work, so nobody waits for it (CPU oversubscription degrades gracefully).

Backends (avx512_bf16, avx512, avx2, their portable emulations and torch, which also takes plain experts with more than
`plain_max_tokens(backend)` tokens), loading the compiled extension, the thread pool's settings (`configure`), the knobs
(`tune`) and the trace: strata.kernels.cpu.library, whose public names this module re-exports (`backend`,
`configure`, `default_threads`, `library`, ...).

Accuracy: `tolerance(backend, kind)` bounds max |out - ref| / max |ref| against `expert_swiglu` in fp32 on the
same weights upcast (quantized experts: dequantized); strata/kernels/cpu/numerics.py says what each bound covers.

Determinism: every dot product is summed in an order fixed by the code and the format (not by the thread
that runs it; an FP8 row block by block), every output element is written by exactly one thread, and each
output element accumulates the kernel's experts in the order given. Results are therefore bit-identical for
any thread count and any scheduling, for a given backend and CPU. Experts sent to torch (plain, more than
plain_max_tokens(backend) tokens: fewer where torch's GEMMs run on AMX; quantized, more than quant_max_tokens(backend,
kind), which is under max_tokens only there) are added after the kernel's experts.
"""

from __future__ import annotations

import array
import ctypes
import threading
from collections.abc import Sequence

import torch

from strata.kernels.cpu import dequant, expert_args
from strata.kernels.cpu.expert_args import (  # noqa: F401 (bf16_expert: this module's API)
    Matrix,
    act_pointers,
    bf16_expert,
    bias_table,
    kernel_format_args,
    matrix_pointers,
    torch_expert,
    weights_format,
)
from strata.kernels.cpu.library import (  # noqa: F401 (used here, or re-exported: the library's API)
    _ISA,
    BACKENDS,
    DEFAULT_PREFETCH_BYTES,
    DEFAULT_SPIN_US,
    META,
    TRACE_FIELDS,
    TUNE_KEYS,
    _resolve,
    available_backends,
    available_isa,
    configure,
    default_threads,
    isa_code,
    library,
    prefetch_bytes,
    read_sweep,
    spin_us,
    torch_gemms_on_amx,
    trace,
    trace_threads,
    tune,
    warm_rows,
)
from strata.kernels.cpu.library import backend as backend  # (as: the calls' `backend=` arguments shadow it)
from strata.kernels.cpu.numerics import QUANT_TOLERANCE, TOLERANCE, tolerance  # noqa: F401
from strata.kernels.experts import PLAIN_SWIGLU, SwiGLUForm
from strata.kernels.quant import ExpertFormat, QuantMatrix

MAX_TOKENS = 32
"""Experts with more tokens than this in one call go to torch's matmul (the CPU is compute-bound there), on the
instruction sets without a prompt-sized register tile; `max_tokens` gives each backend's limit."""
TILE_TOKENS_FACTOR = {"avx512_bf16": 2}
"""Backends whose four-row tile (csrc/cpu_experts_tile4.h) keeps more tokens an expert on the kernel: avx512_bf16's
beat torch's bf16 GEMMs up to ~128 tokens an expert on the development machine (Zen 4: 64 tokens 244-252 against
263-317 ms a layer call of 128 experts), where the fp32 backends fall far behind them at 64."""


AMX_KERNEL_TOKENS = 12
"""Where torch's bf16 GEMMs run on AMX tiles (`torch_gemms_on_amx`), a plain expert with more tokens than this goes to
them under avx512_bf16: a 2-vCPU Xeon VM with AMX ran the bench model's 128-expert layer call in 140.8 ms at 512
tokens (~32 an expert) against the kernel's 252.1 ms (its register tiles run at ~150 GFLOP/s there), 119.1 against
131.5 ms at 256, and the same at 64 and 128 tokens; limits of 10, 16 and 24 did worse (docs/benchmarks.md, "CPU-only
hosts on an AMX Xeon")."""


AMX_QUANT_KERNEL_TOKENS = {"gguf": 16, "mxfp4": 24, "fp8": 28}
"""The same for a quantized expert of each format kind, where `plain_max_tokens` hands plain ones off: with more tokens
it is dequantized to bf16 by the compiled dequantizer (strata.kernels.cpu.dequant: 0.3-0.5 ms the bench model's gate_up
on 2 threads) into a scratch the GEMMs then read, instead of staying on the kernel. That costs an expert 1.5-2.1 ms
whatever its tokens up to 32, the kernel 0.07-0.11 ms a token. On the 2-vCPU AMX Xeon VM, a layer call of the bench
model's 128 experts with T tokens each (bench/cpu/cpu_prompt_layers.py --even; bench/results/
cpu-prompt-layers-quant-even-amx.json), kernel against dequantize+GEMM in ms an expert at T = 12 / 16 / 20 / 24 / 32:
Q4_K 1.23 / 1.63, 1.55 / 1.66, 1.92 / 1.69, 2.30 / 1.66, 3.10 / 1.78; Q6_K 1.37 / 1.61, 1.81 / 1.51, 2.22 / 1.58,
2.66 / 1.56, 3.55 / 1.84 (GGUF: past 16, between the two types' crossings); MXFP4 at 20, 24, 32: 1.57 / 1.61,
1.84 / 1.59, 2.46 / 1.52; FP8 (128 x 128 blocks, twice MXFP4's bytes to dequantize, a faster kernel) 1.95 / 2.03 at
24, 2.69 / 2.14 at 32. With uniform routing a 512-token prompt's layer call (~32 tokens an expert) ran 1.70x (Q4_K),
1.96x (Q6_K), 1.49x (MXFP4) and 1.15x (FP8) faster (cpu-prompt-layers-quant-amx.json); the engine's 512-token prefill
of the 2-layer Q4_K_M cut went from 0.70x llama.cpp's rate to 1.14x (cpu-vs-llamacpp-amx-q4km-dequant.json)."""


def max_tokens(backend: str) -> int:
    """The most tokens an expert has in one kernel call of `backend`: a quantized expert with more is computed in
    groups of this many (a plain one goes to torch's GEMMs from `plain_max_tokens`)."""
    return MAX_TOKENS * TILE_TOKENS_FACTOR.get(backend, 1)


def plain_max_tokens(backend: str, hand_off: bool = True) -> int:
    """The most tokens a plain (bf16) expert has on the kernel of `backend` before it goes to torch's GEMMs: fewer for
    avx512_bf16 (whose bf16 numerics the GEMMs share) on a CPU whose AMX tiles torch's GEMMs run on, unless not
    `hand_off` (the CPU share of a GPU host's prefill: see `CpuCompute.hands_off`). The kernel gives a token the same
    bits whatever else its expert computes; oneDNN's GEMMs do not, so past this count a token's result may depend on
    the other tokens of its pass (a reproducible request's pass holds its tokens alone)."""
    limit = max_tokens(backend)
    bf16 = backend in ("avx512_bf16", "avx512_bf16_emulated")  # the emulation hands off as the kernel it copies
    return min(limit, AMX_KERNEL_TOKENS) if hand_off and bf16 and torch_gemms_on_amx() else limit


def quant_max_tokens(backend: str, kind: str = "gguf", hand_off: bool = True) -> int:
    """The most tokens a quantized expert of format kind `kind` ("gguf", "fp8", "mxfp4") has on the kernel of `backend`
    before it is dequantized to bf16 for torch's GEMMs (`AMX_QUANT_KERNEL_TOKENS`, where `plain_max_tokens` hands plain
    experts off: avx512_bf16 on AMX, `hand_off`); elsewhere `max_tokens(backend)`, past which its tokens run on the
    kernel in groups of that many. Past this count the weights are rounded to bf16 and a token's result may depend on
    the other tokens of its pass, as `plain_max_tokens` says."""
    limit = max_tokens(backend)
    if plain_max_tokens(backend, hand_off) < limit and kind in AMX_QUANT_KERNEL_TOKENS and library() is not None:
        return min(limit, AMX_QUANT_KERNEL_TOKENS[kind])
    return limit


def run_packed(x32: torch.Tensor, meta: array.array, out: torch.Tensor, threads: int | None = None, *,
               backend: str | None = None, warm: array.array | None = None, fmt: ExpertFormat | None = None,
               scales: array.array | None = None, up_offset: int = 0, form: SwiGLUForm = PLAIN_SWIGLU,
               gate_up_bias: array.array | None = None) -> bool:
    """The compiled kernel on pre-packed arguments, for callers that hold experts by address (the tier
    manager's pinned slots): x32 [N, H] fp32 contiguous; meta rows of `META` int64 (gate_up address, down
    address, token-index address (int64), weight address (fp32), T, rows, I), computing each expert's first
    `rows` of its I intermediate rows (all I, or the CPU's part of a split expert); out [N, H] fp32 contiguous,
    added into. The addresses are of the weights' values: bf16, or in `fmt` (FP8, MXFP4: then `scales` holds two
    int64 a expert, the addresses of gate_up's and down's scales; `expert_args.slot_pointers` gives all four of a
    blob; GGUF: the header's, up's rows `up_offset` bytes into gate_up, default the layout's). warm: int64 per
    expert, the leading rows `warm_rows` read ahead on the same thread count (each thread computes its own piece of
    them first; results unchanged). `form`: the experts' SwiGLU form; gate_up_bias: int64 per expert, the address of its
    fp32 gate_up bias row [2 ld] in gate_up's row order (0: none; `expert_args.bias_rows` gives them from a layer's
    table, which must outlive the call). Returns False, doing nothing, when the compiled kernel is not in use."""
    name = _resolve(backend, fmt or "plain")
    if name == "torch" or not meta:
        return bool(not meta and name != "torch")
    N, H = x32.shape
    E = len(meta) // META
    if warm is not None and len(warm) != E:
        raise ValueError(f"warm has {len(warm)} entries for {E} experts")
    act_buf, act, bias = act_pointers(form, gate_up_bias, E)
    up = up_offset or (expert_args.layout_up_offset(fmt, H, meta[6]) if fmt is not None and fmt.kind == "gguf" else 0)
    keep, fmt_ptr, scales_ptr = kernel_format_args(fmt, scales, E, up)
    _check(library().strata_cpu_experts_act(_ISA[name], x32.data_ptr(), N, H, E, meta.buffer_info()[0], fmt_ptr,
                                            scales_ptr, warm.buffer_info()[0] if warm is not None else None, act, bias,
                                            out.data_ptr(), int(threads or default_threads()), None), name, N)
    del keep, act_buf
    return True


def _check(rc: int, name: str, rows: int) -> None:
    """Raise the kernel's error code as an exception (0: success)."""
    if rc == -2:
        raise IndexError(f"token_idx out of range for x with {rows} rows")
    if rc == -5:
        raise ValueError(f"the {name} CPU kernel cannot read these experts: fp8 needs a positive block (and "
                         "AVX512_VBMI on avx512_bf16), mxfp4 H and I multiples of 32, gguf avx512_bf16 and block "
                         "types it reads (expert_args.GGUF_TYPES)")
    if rc == -6:
        raise ValueError(f"the {name} CPU kernel was given a SwiGLU form it does not compute (expert_args.form_args)")
    if rc != 0:
        raise RuntimeError(f"CPU expert kernel ({name}) failed with code {rc}")


class PackedCall:
    """A `start_packed` call: `wait()` returns the kernel's own run time in seconds (raises its error)."""

    def __init__(self, n_rows: int, name: str, keep: tuple):
        self._rows, self._name, self._keep, self._done = n_rows, name, keep, False

    def wait(self) -> float:
        if self._done:
            return 0.0
        seconds = ctypes.c_double(0.0)
        try:
            rc = library().strata_cpu_experts_wait(ctypes.byref(seconds))
        finally:
            self._done, self._keep = True, ()
            _async_slot.release()
        _check(rc, self._name, self._rows)
        return seconds.value


_async_slot = threading.Lock()  # the launcher runs one call at a time


def start_packed(x32: torch.Tensor, meta: array.array, out: torch.Tensor, threads: int | None = None, *,
                 backend: str | None = None, fmt: ExpertFormat | None = None,
                 scales: array.array | None = None, form: SwiGLUForm = PLAIN_SWIGLU,
                 gate_up_bias: array.array | None = None) -> PackedCall | None:
    """`run_packed` on the kernel's launcher thread (share 0 of the pool's job): returns at once, the caller
    keeps driving the GPU; `wait()` joins it. The same thread count as `run_packed` (a different one would
    rebuild the pool at every switch); `form` and `gate_up_bias` as there (the bias rows held until `wait()`).
    None, doing nothing, when the compiled kernel is not in use or another call is in flight."""
    name = _resolve(backend, fmt or "plain")
    if name == "torch" or not meta:
        return None
    act_buf, act, bias = act_pointers(form, gate_up_bias, len(meta) // META)
    up = expert_args.layout_up_offset(fmt, x32.shape[1], meta[6]) if fmt is not None and fmt.kind == "gguf" else 0
    args, fmt_ptr, scales_ptr = kernel_format_args(fmt, scales, len(meta) // META, up)
    if not _async_slot.acquire(blocking=False):
        return None
    n_rows, hidden = x32.shape
    threads = threads or default_threads()
    library().strata_cpu_experts_start(_ISA[name], x32.data_ptr(), n_rows, hidden, len(meta) // META,
                                       meta.buffer_info()[0], fmt_ptr, scales_ptr, act, bias, out.data_ptr(),
                                       int(threads))
    return PackedCall(n_rows, name, (x32, meta, out, args, scales, act_buf, gate_up_bias))


def start_mailbox(cfg, boxes, layers, addresses, log, counters, acts=None, biases=None) -> int:
    """Start the native mailbox worker (csrc/cpu_mailbox.cpp; the arguments are numpy arrays laid out as
    strata.runtime.offload.mailbox describes, kept alive by the caller until `stop_mailbox`; cfg[7] the `isa_code`);
    acts float64 [boxes, 4] each box's SwiGLU form (`expert_args.form_args`' values; None: plain), biases int64 [boxes]
    the address of each box's fp32 gate_up bias table [E, 2I] (0: none; None: no biases). Its handle, 0 when the
    compiled kernel is not in use (isa code 0)."""
    lib = library()
    if lib is None or int(cfg[7]) == 0:
        return 0
    arrays = (cfg, boxes, layers, addresses, log, counters)
    return int(lib.strata_mailbox_start(*(a.ctypes.data for a in arrays), None if acts is None else acts.ctypes.data,
                                        None if biases is None else biases.ctypes.data))


def mailbox_warm(handle: int, next_layers, plans: int, slots: int, nbytes: int, counters) -> int:
    """Give the mailbox worker `handle` its warm-ahead (csrc/cpu_mailbox.cpp, `strata_mailbox_warm`): next_layers
    and counters int64 numpy arrays, plans the address of warm-ahead's page-locked plans. 0 on success."""
    lib = library() if handle else None  # a running worker's handle: the library is loaded already
    if lib is None:
        return -1
    return int(lib.strata_mailbox_warm(handle, next_layers.ctypes.data, plans, slots, nbytes, counters.ctypes.data))


def stop_mailbox(handle: int, *keep) -> None:
    """Stop the mailbox worker `handle` (joins its thread); `keep`: what the worker reads, held until then."""
    lib = library() if handle else None  # a running worker's handle: the library is loaded already
    if lib is not None:
        lib.strata_mailbox_stop(handle)


def cpu_experts_forward(x: torch.Tensor, weights: Sequence[tuple[Matrix, Matrix]],
                        token_idx: Sequence[torch.Tensor], token_w: Sequence[torch.Tensor],
                        out: torch.Tensor | None = None, threads: int | None = None, *,
                        backend: str | None = None, form: SwiGLUForm = PLAIN_SWIGLU,
                        gate_up_bias: torch.Tensor | None = None,
                        expert_ids: Sequence[int] | None = None, hand_off: bool = True) -> torch.Tensor:
    """out[N, H] (fp32, added into; zeros when None) += sum over experts e of token_w[e] * expert_e(x[token_idx[e]]).

    x [N, H] fp32 or bf16 (CPU); weights[e] = (gate_up [2I, H], down [H, I]): bf16 CPU tensors, each its own
    buffer, or two `QuantMatrix` (strata.kernels.quant: FP8, MXFP4 or GGUF views of a blob, one format for every
    expert with tokens; the kernel reads them as they are); token_idx[e] int64 rows of x (may be empty); token_w[e]
    fp32 routing weights of those rows. `threads`: the kernel's thread count (default `default_threads()`; the torch path
    ignores it). `backend`: the instruction set ("auto" or None: the best this CPU runs for the experts' format;
    "torch": the reference math, on dequantized weights for a quantized format).
    `form`: the experts' SwiGLU form (strata.kernels.experts.SwiGLUForm; the plain SwiGLU by default). `gate_up_bias`: a
    layer's gate_up bias table [E, 2I] in gate_up's row order, added before the form; expert_ids[e] is weights[e]'s row
    of it (default e). Hand it fp32, contiguous and on the CPU (`expert_args.bias_table`, once) or it is converted
    every call. The reference: `strata.kernels.experts.expert_swiglu` (the down bias is not added here: `down_bias_term`).
    `hand_off`: plain experts of more than `plain_max_tokens(backend)` tokens go to torch's GEMMs, and quantized ones of
    more than `quant_max_tokens(backend, kind)`, dequantized to bf16 first (False: they stay on the kernel up to
    `max_tokens(backend)`, a quantized one's tokens in groups of that many past it).
    """
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"x must be a [N, H] CPU tensor, got {tuple(x.shape)} on {x.device}")
    if not (len(weights) == len(token_idx) == len(token_w)):
        raise ValueError("weights, token_idx and token_w need one entry per expert")
    N, H = x.shape
    if out is None:
        out = torch.zeros(N, H, dtype=torch.float32)
    elif out.shape != (N, H) or out.dtype != torch.float32 or out.device.type != "cpu":
        raise ValueError(f"out must be a [{N}, {H}] fp32 CPU tensor, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if expert_ids is not None and len(expert_ids) != len(weights):
        raise ValueError(f"expert_ids has {len(expert_ids)} entries for {len(weights)} experts")
    table = bias_table(gate_up_bias) if gate_up_bias is not None else None
    fmt = weights_format(weights, token_idx)
    up = expert_args.gguf_up_offset(weights, token_idx) if fmt is not None and fmt.kind == "gguf" else 0
    name = _resolve(backend, fmt or "plain")
    x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    limit = 0 if name == "torch" else max_tokens(name)
    plain_limit = 0 if name == "torch" else plain_max_tokens(name, hand_off)
    quant_limit = 0 if name == "torch" or fmt is None else quant_max_tokens(name, fmt.kind, hand_off)
    bf16 = torch.bfloat16
    meta = array.array("q")
    scales = array.array("q")  # quantized experts: their gate_up and down scales' addresses
    biases = array.array("q")  # with a bias table: each meta row's bias row address
    bias_row: dict[int, int] = {}  # expert -> its row of the bias table
    keep = []  # converted tensors must outlive the call
    to_torch = []
    for e in range(len(weights)):  # a few µs per expert: this loop is the per-layer Python overhead
        idx = token_idx[e]
        T = idx.numel()
        if T == 0:
            continue
        gate_up, down = weights[e]
        if isinstance(gate_up, QuantMatrix) and gate_up.kind == "plain":
            gate_up, down = gate_up.values, down.values
        quant = isinstance(gate_up, QuantMatrix)
        if quant != (fmt is not None):
            raise ValueError(f"experts of one CPU kernel call come in one format: expert {e} is "
                             f"{'a QuantMatrix' if quant else 'a tensor'} among {fmt.name if fmt else 'tensors'}; "
                             "call the kernel once per format")
        w = token_w[e]
        inter = down.shape[-1]
        if tuple(gate_up.shape) != (2 * inter, H) or tuple(down.shape) != (H, inter):
            raise ValueError(f"expert {e}: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
                             f"match H={H} (want [2I, H] and [H, I])")
        if w.numel() != T:
            raise ValueError(f"expert {e}: {T} token rows but {w.numel()} routing weights")
        bias_ptr = 0
        if table is not None:
            row = e if expert_ids is None else int(expert_ids[e])
            if not 0 <= row < table.shape[0] or table.shape[1] != 2 * inter:
                raise ValueError(f"expert {e}: no row {row} of {2 * inter} biases in gate_up_bias "
                                 f"{tuple(table.shape)}")
            bias_ptr, bias_row[e] = table.data_ptr() + 4 * table.shape[1] * row, row
        # (a quantized expert's values and scales are checked by matrix_pointers)
        if not ((quant or (gate_up.is_cpu and down.is_cpu)) and idx.is_cpu and w.is_cpu):
            raise ValueError(f"expert {e}: weights, token_idx and token_w must be CPU tensors")
        # plain experts with more tokens than the kernel takes go to torch's GEMMs; a quantized one too where they
        # run on AMX (`quant_max_tokens`: dequantized to bf16 first), else it stays on the kernel, its tokens in
        # groups of `limit` (each group reads the expert again, still far cheaper than dequantizing it with torch ops)
        if quant and limit:  # (checks the expert, whether the kernel or the dequantizer reads it)
            gu_ptr, dn_ptr, gus_ptr, dns_ptr = matrix_pointers(gate_up, down, H, keep, up)
        if (T > (quant_limit if quant else plain_limit) and not (quant and limit and quant_limit == limit)) \
                or (not quant and (gate_up.dtype is not bf16 or down.dtype is not bf16)):
            to_torch.append(e)
            continue
        if not quant:
            if not gate_up.is_contiguous():
                gate_up = gate_up.contiguous()
                keep.append(gate_up)
            if not down.is_contiguous():
                down = down.contiguous()
                keep.append(down)
            gu_ptr, dn_ptr = gate_up.data_ptr(), down.data_ptr()
        if idx.dtype is not torch.int64 or not idx.is_contiguous():
            idx = idx.to(torch.int64).contiguous()
            keep.append(idx)
        if w.dtype is not torch.float32 or not w.is_contiguous():
            w = w.to(torch.float32).contiguous()
            keep.append(w)
        for s0 in range(0, T, limit):  # [T] token rows, in groups of at most `limit`
            n = min(limit, T - s0)
            meta.extend((gu_ptr, dn_ptr, idx.data_ptr() + 8 * s0, w.data_ptr() + 4 * s0, n, inter, inter))
            if quant:
                scales.extend((gus_ptr, dns_ptr))
            if table is not None:
                biases.append(bias_ptr)
    if meta:
        target = out if out.is_contiguous() else torch.zeros(N, H, dtype=torch.float32)
        run_packed(x32, meta, target, threads, backend=name, fmt=fmt, scales=scales if fmt is not None else None,
                   up_offset=up, form=form, gate_up_bias=biases if table is not None else None)
        if target is not out:
            out.add_(target)
    for e in to_torch:
        (gate_up, down), idx, w = weights[e], token_idx[e], token_w[e]
        if idx.numel() and (idx.min() < 0 or idx.max() >= N):
            raise IndexError(f"token_idx out of range for x with {N} rows")
        if isinstance(gate_up, QuantMatrix) and gate_up.kind == "plain":
            gate_up, down = gate_up.values, down.values
        bias = table[bias_row[e]] if table is not None else None
        if name != "torch" and isinstance(gate_up, QuantMatrix):
            scratch = dequant.scratch(gate_up.shape, down.shape)  # [2I, H], [H, I] bf16, reused expert after expert
            dequant.dequantize_expert(gate_up, down, scratch)
            bf16_expert(x, *scratch, idx, w, out, form, bias)
        elif name != "torch" and isinstance(gate_up, torch.Tensor) and gate_up.dtype is bf16 and down.dtype is bf16:
            bf16_expert(x, gate_up, down, idx, w, out, form, bias)  # prefill-sized, compute-bound: oneDNN's bf16 GEMMs
        else:
            torch_expert(x32, gate_up, down, idx, w, out, form, bias)
    return out


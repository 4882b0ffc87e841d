"""The builds of the decode step's Triton kernels, counted and timed on any machine, no GPU needed: Triton's binder
gives each launch's specialization key for an H200 (sm_90) target, and each new key is compiled for that target on
this machine's CPU (Triton's wheel carries ptxas). What a fresh install's serving warm-up (strata.runtime.generation.warmup)
spends on them: one decode graph per batch size, each launching the per-layer kernels (the mailbox's pack and fetch,
warm-ahead's plan: the default sweep) once per MoE layer, and the step's other kernels (`--model`).

    python bench/kernel_builds.py [--layers 48] [--max-batch 8] [--top-k 8] [--model [--max-context 4096]]
                                  [--no-compile] [--out DIR]

Triton builds a kernel once per key: its constexprs, each plain int argument's class (1, a multiple of 16, other)
and each pointer's alignment. bench/jit_probe.py times every build of a real warm-up, on the GPU machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

E, H, INTER = 128, 2048, 768  # the bench model's experts (Qwen3-30B-A3B's shapes)
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 128, 151936  # its attention and vocabulary
BUCKETS = (512, 1024, 2048, 4096)  # the KV buckets the serving warm-up visits (up to its 4096)


class Unavailable(RuntimeError):
    """What the probe needs is not here: Triton's binder as this knows it, or the compiled CPU expert kernel."""


@contextlib.contextmanager
def recorded_launches(compile_for: tuple[int, int] | None = None):
    """Every Triton launch in the block is recorded, not run: yields {kernel name: {key: build seconds or None}}.
    compile_for = (major, minor): each new key is compiled for that CUDA architecture here, and timed. Raises
    `Unavailable` where this Triton's binder is not the one this knows (its internals)."""
    import triton
    import triton.runtime.jit as jit
    from triton import knobs

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend

        major, minor = compile_for or (9, 0)
        target = GPUTarget("cuda", major * 10 + minor, 32)
        backend = make_backend(target)
        make_binder = jit.create_function_from_signature
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"this Triton's binder is not the one bench/kernel_builds.py knows: {e}") from e
    keys: dict[str, dict] = collections.defaultdict(dict)
    binders: dict = {}

    # the options JITFunction.run adds to a launch's, where this Triton has them
    added = [name for name in ("instrumentation_mode", "fpsan_homomorphic_casts") if hasattr(knobs.compilation, name)]

    def record(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs.update({name: getattr(knobs.compilation, name) for name in added})
        binder = binders.get(self.fn)
        if binder is None:
            binder = binders[self.fn] = make_binder(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        key = repr((specialization, sorted(options.items())))
        seen = keys[self.fn.__name__]
        if key in seen:
            return
        seen[key] = None
        if compile_for is not None:
            opts, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
            t = time.perf_counter()
            triton.compile(ASTSource(self, signature, constexprs, attrs), target=target, options=opts.__dict__)
            seen[key] = time.perf_counter() - t

    original = jit.JITFunction.run
    jit.JITFunction.run = record
    try:
        yield keys
    finally:
        jit.JITFunction.run = original


def _zeros(dtype):
    return lambda *shape: torch.zeros(*shape, dtype=dtype)


def pack_launch(n: int, layer: int, share, top_k: int, hidden: int = H) -> None:
    """A synthetic decode layer's fused mailbox pack for n tokens: the inbox in host memory and the GPU share's
    split."""
    from strata.kernels.gpu import mailbox_pack
    from strata.runtime.offload.mailbox import inbox_layout

    i32, i64 = _zeros(torch.int32), _zeros(torch.int64)
    p = n * top_k
    x_off, nbytes = inbox_layout(n, top_k, hidden)
    box = torch.zeros(nbytes, dtype=torch.uint8)
    mailbox_pack.pack_mailbox(box, i32(p), i32(p), torch.zeros(n, hidden, dtype=torch.bfloat16),
                              torch.zeros(n, top_k, dtype=torch.bfloat16), x_off, INTER, share, layer, rows=i32(p),
                              addr=i64(p), ready=(i64(1), i64(1), i32(1)),
                              zero=torch.zeros(p * hidden, dtype=torch.float32))


def gpu_share(layers: int, hidden: int = H):
    """A GPU share over a synthetic address table of `layers` x E experts (the pack reads only its shapes)."""
    from strata.kernels.gpu.grouped import HostExperts
    from strata.runtime.offload.gpu_share import GpuShare

    table = (np.arange(layers * E, dtype=np.int64).reshape(layers, E) + 1) * 4096
    experts = HostExperts(torch.bfloat16, (2 * INTER, hidden), (hidden, INTER), 3 * INTER * hidden * 2)
    return GpuShare(table, experts, torch.device("cpu"), 0.4, adaptive=False)


@contextlib.contextmanager
def decode_objects(layers: int, max_tokens: int, top_k: int, hidden: int = H):
    """The one-graph split decode objects whose buffers the per-layer kernels take, built on the CPU as serving
    builds them on the GPU (their layouts decide the pointers' alignment): the mailbox (its worker started, never
    posted), its GPU share and warm-ahead's plan ([debug] warm_ahead, on by default). Yields (mailbox, share, ahead)."""
    from strata.kernels.cpu import experts as ce
    from strata.kernels.gpu import mailbox_pack
    from strata.kernels.gpu import warm_plan as wp
    from strata.runtime.offload.mailbox import CpuMailbox
    from strata.runtime.offload.warm_ahead import WarmAhead

    if ce.backend() == "torch":
        raise Unavailable("the mailbox's buffers need the compiled CPU expert kernel (its worker)")
    share = gpu_share(layers, hidden)
    addresses = share.table.numpy()
    gu_bytes = 2 * INTER * hidden * 2
    box = CpuMailbox(list(range(layers)), addresses, hidden=hidden, inter=INTER, gu_bytes=gu_bytes,
                     payload=gu_bytes * 3 // 2, top_k=top_k, max_tokens=max_tokens, threads=1, device=torch.device("cpu"))
    box.direct, box._direct_checked = True, True  # the GPU's exchange (its fetch kernel's self-check needs a GPU)
    available = (mailbox_pack.available, wp.available)
    mailbox_pack.available = wp.available = lambda x: True  # the GPU's launches, on CPU tensors (recorded, never run)
    try:
        slot_of = torch.full((layers, E), -1, dtype=torch.int32)
        ahead = WarmAhead(addresses, slot_of, {layer: None for layer in range(1, layers)}, list(range(layers)),
                          torch.device("cpu"), box)
        yield box, share, ahead
    finally:
        mailbox_pack.available, wp.available = available
        box.close()


def exchange_launch(box, share, layer: int, n: int, hidden: int = H) -> None:
    """Layer `layer`'s direct exchange for n tokens as `CpuMailbox.exchange` makes it on the GPU: the fused pack
    (inbox posted by the kernel itself) and the kernels that wait for the worker's answer and fetch it."""
    from strata.kernels.gpu.host_signal import MAX_SPINS
    from strata.runtime.offload.mailbox import inbox_layout

    k = box.top_k
    p = n * k
    y = torch.empty(p, hidden, dtype=torch.float32)
    box._exchange_direct(box._box[layer], torch.zeros(p, dtype=torch.int64), torch.full((p,), -1, dtype=torch.int32),
                         torch.zeros(n, hidden, dtype=torch.bfloat16), torch.zeros(n, k), *inbox_layout(n, k, hidden),
                         None, MAX_SPINS, share, y)


@contextlib.contextmanager
def as_on_the_gpu():
    """The kernels' wrappers take their GPU path on CPU tensors (launches recorded, never run), with programmatic
    dependent launch on, as on the H200."""
    from strata.kernels.gpu import fused, pdl

    saved = fused._INTERPRET, pdl.on
    fused._INTERPRET, pdl.on = True, (lambda x: True)
    try:
        yield
    finally:
        fused._INTERPRET, pdl.on = saved


def model_launches(n: int, length: int, top_k: int, share, max_len: int = 4096) -> None:
    """The rest of a decode step's kernels for n tokens at KV length `length` (its bucket), as one-graph split
    decode launches them on the bench model: a layer's norms, projections (GEMV at one token), cache write,
    attention, router, resident pairs, in-place share and combine, then the head's norm and projection."""
    from strata.kernels.gpu import decode_gemv, decode_router, fused, grouped
    from strata.kernels.gpu.decode_attention import decode_attention

    bf, eps, p = torch.bfloat16, 1e-6, n * top_k
    x, w = torch.zeros(n, H, dtype=bf), torch.ones(H, dtype=bf)
    fused.rms_norm(x, w, eps)  # the first layer's input norm
    fused.add_rms_norm(x, x, w, eps)  # the others', and each post-attention norm: the residual added in
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    decode_gemv.linear(x, torch.empty(qkv_rows, H, dtype=bf))  # a GEMV at one token, else cuBLAS
    q, k, v = torch.zeros(n, qkv_rows, dtype=bf).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], 1)
    cache, cos = torch.empty(8, max_len, KV_HEADS, HEAD_DIM, dtype=bf), torch.zeros(n, HEAD_DIM, dtype=bf)
    pos, hw = torch.zeros(n, dtype=torch.int64), torch.ones(HEAD_DIM, dtype=bf)
    q = fused.norm_rope_into_cache(k.view(n, KV_HEADS, HEAD_DIM), v.view(n, KV_HEADS, HEAD_DIM), cos, cos, hw, eps,
                                   cache, cache, pos, pos, q=q.view(n, HEADS, HEAD_DIM), q_weight=hw, q_eps=eps)
    o = decode_attention(q, cache, cache, pos, pos, length, None, HEAD_DIM**-0.5)
    decode_gemv.linear(o.reshape(n, -1), torch.empty(H, HEADS * HEAD_DIM, dtype=bf))
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    weights, _, used = decode_router.route(x, torch.empty(E, H, dtype=bf), top_k, True,
                                           decode_router.new_counts(x.device), slot_of)
    y = torch.empty(p, H, dtype=torch.float32)
    slots = grouped.SlotWeights(torch.empty(2, 2 * INTER, H, dtype=bf), torch.empty(2, H, INTER, dtype=bf))
    # the resident pairs, as `pair_experts` launches them on the GPU (slot table `used`, ids the pair index)
    grouped._pair_triton(x, slots, used, torch.arange(p, dtype=torch.int32), None, top_k, y, torch.empty_like(used))
    grouped.pair_experts_in_place(x, share.experts, torch.zeros(p, dtype=torch.int64), y,
                                  first_row=torch.zeros(p, dtype=torch.int32))  # the GPU's share of the cold rows
    grouped.combine_pairs(y, weights, bf, extra=torch.zeros(n, H), residual=x)
    fused.rms_norm(x, w, eps)  # the head
    decode_gemv.linear(x, torch.empty(VOCAB, H, dtype=bf))


def sweep(layers: int, max_batch: int, top_k: int, model: bool = False, max_context: int = BUCKETS[-1]) -> None:
    """The per-layer launches of every decode graph (batch sizes 1..max_batch, each over every layer): the
    exchange and the next layer's warm-ahead plan; with `model`, also the step's other kernels, at the first KV
    bucket for every batch size and at each larger bucket up to `max_context` for one token (the serving
    warm-up's passes)."""
    with as_on_the_gpu(), decode_objects(layers, max_batch, top_k) as (box, share, ahead):
        for n in range(1, max_batch + 1):
            for layer in range(layers):
                exchange_launch(box, share, layer, n)
                if layer + 1 in ahead.next_of.values():
                    ahead.plan(layer + 1, torch.zeros(n, top_k, dtype=torch.int64))
            if model:
                model_launches(n, BUCKETS[0], top_k, share)
        for length in [b for b in BUCKETS[1:] if b <= max_context] if model else ():
            model_launches(1, length, top_k, share)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--model", action="store_true", help="also the step's other kernels (norms, attention, router, "
                   "expert pairs, combine, GEMV) over the warm-up's batch sizes and KV buckets")
    p.add_argument("--max-context", type=int, default=BUCKETS[-1], help="with --model: the buckets visited")
    p.add_argument("--no-compile", action="store_true", help="count the keys only")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    with recorded_launches(None if a.no_compile else (9, 0)) as keys:
        sweep(a.layers, a.max_batch, a.top_k, a.model, a.max_context)
    out = {"layers": a.layers, "max_batch": a.max_batch, "top_k": a.top_k, "model": a.model,
           "max_context": a.max_context,
           "target": "sm_90", "kernels": {name: {"builds": len(k), "seconds": None if a.no_compile else
                                                 round(sum(k.values()), 2)} for name, k in keys.items()}}
    for name, row in out["kernels"].items():
        print(f"{name:24s} {row['builds']:3d} builds" + (f"  {row['seconds']:6.2f} s" if row["seconds"] is not None else ""))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "kernel_builds.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

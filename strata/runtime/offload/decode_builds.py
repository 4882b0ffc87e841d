"""The Triton builds a decode step costs, replayed on the CPU: its launches as serving makes them on the GPU.

A fresh install's serving warm-up (strata.runtime.generation.warmup) captures one decode graph per batch size,
each launching the per-layer kernels (the mailbox's pack and fetch, warm-ahead's plan) once per MoE layer, and the
step's other kernels (norms, projections, cache write, attention, router, expert pairs, combine) at each KV bucket
it visits. `sweep` makes those launches with the real objects' buffers, built on the CPU as serving builds them
on the GPU (their layouts decide the pointers' alignment, part of Triton's key); inside
`strata.kernels.gpu.builds.recorded_launches` nothing runs and each launch's key for a GPU target is recorded (and,
asked to, compiled). `count_builds` is the whole probe: builds per kernel and their compile seconds for sm_90.

The shapes are the bench demo model's (Qwen3-30B-A3B's experts, attention and vocabulary).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from strata.kernels.gpu.builds import H200, Unavailable, as_on_the_gpu, build_counts, recorded_launches, target_name

E, H, INTER = 128, 2048, 768  # the bench model's experts (Qwen3-30B-A3B's shapes)
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 128, 151936  # its attention and vocabulary
BUCKETS = (512, 1024, 2048, 4096)  # the KV buckets the serving warm-up visits (up to its 4096)


def gpu_share(layers: int, hidden: int = H):
    """A GPU share over a synthetic address table of `layers` x E experts (the pack reads only its shapes)."""
    from strata.kernels.gpu.experts.grouped import HostExperts
    from strata.runtime.offload.gpu_share import GpuShare

    table = (np.arange(layers * E, dtype=np.int64).reshape(layers, E) + 1) * 4096
    experts = HostExperts(torch.bfloat16, (2 * INTER, hidden), (hidden, INTER), 3 * INTER * hidden * 2)
    return GpuShare(table, experts, torch.device("cpu"), 0.4, adaptive=False)


@contextlib.contextmanager
def decode_objects(layers: int, max_tokens: int, top_k: int, hidden: int = H) -> Iterator[tuple]:
    """The one-graph split decode objects whose buffers the per-layer kernels take, built on the CPU as serving
    builds them on the GPU: the mailbox (its worker started, never posted), its GPU share and warm-ahead's plan
    ([debug] warm_ahead, on by default). Yields (mailbox, share, ahead); their kernels' wrappers take the GPU path
    on CPU tensors inside the block. Raises `Unavailable` without the compiled CPU expert kernel (the mailbox's
    worker)."""
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
    # the GPU's direct exchange, its fetch kernel's self-check taken as passed (that check runs it: it needs a GPU)
    box.take_direct_exchange()
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
    (inbox posted by the kernel itself) and the kernels that wait for the worker's answer and fetch it. Only
    inside `recorded_launches` (the launches must not run: nothing answers them)."""
    k = box.top_k
    p = n * k
    y = torch.empty(p, hidden, dtype=torch.float32)
    # the GPU path of `CpuMailbox.exchange`, which takes the host path on a CPU mailbox
    box.exchange_direct(layer, torch.zeros(p, dtype=torch.int64), torch.full((p,), -1, dtype=torch.int32),
                        torch.zeros(n, hidden, dtype=torch.bfloat16), torch.zeros(n, k), share=share, zero=y)


def model_launches(n: int, length: int, top_k: int, share, max_len: int = BUCKETS[-1]) -> None:
    """The rest of a decode step's kernels for n tokens at KV length `length` (its bucket), as one-graph split
    decode launches them on the bench model: a layer's norms, projections (GEMV at one token), cache write,
    attention, router, resident pairs, in-place share and combine, then the head's norm and projection. Only
    inside `as_on_the_gpu` and `recorded_launches`."""
    from strata.kernels.gpu import decode_gemv, decode_router, fused
    from strata.kernels.gpu.decode_attention import decode_attention
    from strata.kernels.gpu.experts import grouped

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
    warm-up's passes). Only inside `recorded_launches`."""
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


def count_builds(layers: int = 48, max_batch: int = 8, top_k: int = 8, model: bool = False,
                 max_context: int = BUCKETS[-1], compile: bool = True, target: tuple[int, int] = H200) -> dict:
    """`sweep` under the recorder for `target`: {"layers", "max_batch", "top_k", "model", "max_context", "target"
    ("sm_90"), "kernels": {name: {"builds": keys, "seconds": compile seconds (None without `compile`)}}}, a
    JSON-ready report. Raises `Unavailable` where the recorder or the mailbox's worker is missing."""
    with recorded_launches(target, compile) as keys:
        sweep(layers, max_batch, top_k, model, max_context)
    return {"layers": layers, "max_batch": max_batch, "top_k": top_k, "model": model, "max_context": max_context,
            "target": target_name(target), "kernels": build_counts(keys)}


def describe_builds(report: dict) -> list[str]:
    """`count_builds`' report as lines, one a kernel: its name, builds and (compiled) seconds."""
    return [f"{name:24s} {row['builds']:3d} builds" + (f"  {row['seconds']:6.2f} s" if row["seconds"] is not None else "")
            for name, row in report["kernels"].items()]

"""The quantized decode pair kernels (strata.kernels.gpu.experts.quant_pairs) against the bf16 ones at the bench model's
shapes, and prefill's scratch dequantizer (strata.kernels.gpu.experts.quant_slots).

    python bench/probes/quant_pair_probe.py --out DIR [--tokens 1,4,8] [--sweep] [--formats fp8,mxfp4,q4_k_m] [--in-place]

The same 128 random experts are held in GPU slots as bf16, FP8 (128 x 128 blocks) and MXFP4 blobs, and 128 experts of
random valid GGUF blocks as Q4_K_M stores them (gate and up Q4_K, down Q6_K; strata.kernels.gpu.experts.gguf_pairs). For
N tokens (N x 8 pairs, each token's experts distinct), one step's pairs (the gate/up and the down launch) are timed in a
CUDA graph of 16 steps over different experts, so weights come from HBM, not the L2. Prints us a step, the weight bytes
a step reads (pairs x blob bytes), that rate in TB/s and each format's speed-up over bf16; --sweep also times the
quantized kernels' launch configurations (gate/up swept with down at the shipped one, then down; GGUF's from
`GGUF_PAIR_CONFIG`). Every output is checked against the fp32 torch path on the dequantized weights (rel_err: largest
error / largest output). Then the scratch dequantizer over all 128 experts to bf16 (GB/s of blob bytes read plus bf16
bytes written). --in-place times instead the reads of cold experts in place: every format's slots in page-locked host
RAM, each pair's weights read over PCIe by the in-place kernels (`pair_experts_in_place`; GB/s of blob bytes a step),
--sweep then timing their tiles (`IN_PLACE_GATE_UP`, `IN_PLACE_DOWN`). Writes quant_pairs.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.*` when run as a script
from bench.cpu.cpu_experts import gguf_blocks  # noqa: E402
from strata.kernels.gpu.experts import grouped, quant_pairs  # noqa: E402
from strata.kernels.gpu.experts.gguf_pairs import GGUF_IN_PLACE_BLOCKS, GGUF_PAIR_CONFIG  # noqa: E402
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights, dequantize_slots  # noqa: E402
from strata.kernels.quant import ExpertFormat, ExpertLayout  # noqa: E402

H, INTER, E, K = 2048, 768, 128, 8
CALLS = 16
FORMATS = {"bf16": ExpertFormat(), "fp8": ExpertFormat("fp8", block=(128, 128)), "mxfp4": ExpertFormat("mxfp4")}
GGUF_FORMATS = {"q4_k_m": (("Q4_K",), ("Q4_K",), ("Q6_K",))}  # gate, up and down block types
GATE_UP = list(itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (3,)))
DOWN = list(itertools.product((8, 16, 32), (128, 256, 512), (2, 4), (3,)))
# GGUF's: column steps of whole 256-value superblocks
GGUF_GATE_UP = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3)))
GGUF_DOWN = list(itertools.product((8, 16, 32, 64), (256, 512), (4, 8), (2, 3)))
# reads in place: gate/up (rows, columns) and down (rows, columns), each side swept with the other as shipped; columns
# of whole 256-value superblocks, so that GGUF's tiles fit too
IN_PLACE_GATE_UP = list(itertools.product((4, 8, 16), (512, 1024)))
IN_PLACE_DOWN = list(itertools.product((8, 16, 32), (256, 512)))


def slots(fmt: ExpertFormat, gu: torch.Tensor, dn: torch.Tensor):
    """Experts gu [E, 2I, H], dn [E, H, I] packed in `fmt` into a slab of 4 KiB-aligned slots, as the GPU tier
    holds them: (SlotWeights or QuantSlotWeights, blob bytes, the slab [E, slot bytes] uint8, its layout)."""
    layout = ExpertLayout.build(fmt, H, INTER)
    slab = torch.zeros(gu.shape[0], -(-layout.payload_bytes // 4096) * 4096, dtype=torch.uint8, device=gu.device)
    for e in range(gu.shape[0]):
        layout.pack(gu[e], dn[e], out=slab[e])
    return grouped.slot_weights(slab, layout), layout.payload_bytes, slab, layout


def gguf_slots(types: tuple[tuple[str, ...], ...], device: str, seed: int = 0):
    """E experts of random valid blocks of `types` (gate, up, down: one type each) in 4 KiB-aligned slots on `device`:
    (QuantSlotWeights, blob bytes, the slab, its layout), as `slots` returns them."""
    layout = ExpertLayout.build(ExpertFormat("gguf", ggml=types), H, INTER)
    slab = torch.zeros(E, -(-layout.payload_bytes // 4096) * 4096, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    for e in range(E):
        gate, up, down = (gguf_blocks(t[0], rows, k, g) for t, (rows, k) in
                          zip(types, ((INTER, H), (INTER, H), (H, INTER)), strict=True))
        layout.pack_gguf(gate, up, down, out=slab[e])
    sw = QuantSlotWeights(slab.to(device), layout)
    return sw, layout.payload_bytes, sw.slab, layout


def shipped_and_swept(kind: str, p: int) -> list:
    """The launch configurations --sweep times for experts of format `kind` at p pairs: the shipped one (None) first,
    then gate/up swept with down at the shipped one, then down."""
    if kind == "gguf":
        (gu0, dn0), gate_up, down = GGUF_PAIR_CONFIG, GGUF_GATE_UP, GGUF_DOWN
    else:
        (gu0, dn0), gate_up, down = quant_pairs._config(p, 1), GATE_UP, DOWN
    return [None] + [(c, dn0) for c in gate_up if c != gu0] + [(gu0, c) for c in down if c != dn0]


def in_place_configs(kind: str, sweep: bool) -> list:
    """The in-place tiles timed for experts of format `kind`: the shipped ones (None) first, with --sweep gate/up's
    swept with down's as shipped, then down's (bf16's shipped only: its kernels take no tiles from the probe)."""
    if not sweep or kind == "plain":
        return [None]
    gi, gh, do, dk = GGUF_IN_PLACE_BLOCKS if kind == "gguf" else quant_pairs.QUANT_IN_PLACE_BLOCKS
    return ([None] + [(i, h, do, dk) for i, h in IN_PLACE_GATE_UP if (i, h) != (gi, gh)]
            + [(gi, gh, o, k) for o, k in IN_PLACE_DOWN if (o, k) != (do, dk)])


def host_addresses(slab: torch.Tensor, slot_of: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[P] int64 on ids' device: the host address of pair p's slot in `slab` (page-locked host RAM on a GPU machine;
    the interpreter reads CPU memory by address)."""
    return (slab.data_ptr() + slot_of[ids.long()].long().cpu() * slab.stride(0)).to(ids.device)


def run_in_place(x, layout: ExpertLayout, addresses, y, blocks=None) -> None:
    """One step's pairs read in place from host slots of `layout` (at tiles `blocks`, quantized formats)."""
    if layout.fmt.quantized:
        quant_pairs.pair_quant_in_place(x, layout, addresses, y, blocks=blocks)
    else:
        grouped.pair_experts_in_place(x, grouped.HostExperts.of_layout(layout), addresses, y)


def run_pairs(x, sw, slot_of, ids, y, used, config=None) -> None:
    """One step's pairs as decode runs them: the quantized kernels' launches (at `config`), or the bf16 kernels."""
    if isinstance(sw, QuantSlotWeights):
        quant_pairs.pair_quant(x, sw, slot_of, ids, None, K, y, used, config=config)
    else:
        grouped.pair_experts(x, sw, slot_of, ids, y, used=used)


def reference(x, sw, slot_of, ids) -> torch.Tensor:
    """fp32 [P, H]: each pair on the dequantized weights (`ExpertLayout.dequantize`'s values)."""
    gu, dn = sw.gather(slot_of[ids.long()].long(), torch.float32)
    xs = x.float()[torch.arange(ids.numel(), device=x.device) // K]
    gate, up = torch.bmm(gu.float(), xs[:, :, None])[..., 0].chunk(2, dim=-1)
    return torch.bmm(dn.float(), (F.silu(gate) * up)[:, :, None])[..., 0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def main() -> None:
    from bench.probes.gemv_probe import graph_us

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--formats", default="fp8,mxfp4,q4_k_m", help="the quantized formats timed against bf16")
    ap.add_argument("--in-place", action="store_true", help="the slots in page-locked host RAM, read in place")
    args = ap.parse_args()
    chosen = {"bf16", *args.formats.split(",")}
    torch.manual_seed(0)
    dev = "cuda"
    gu = torch.randn(E, 2 * INTER, H, device=dev) / H**0.5
    dn = torch.randn(E, H, INTER, device=dev) / INTER**0.5
    packed = {name: slots(fmt, gu, dn) for name, fmt in FORMATS.items() if name in chosen}
    del gu, dn
    packed.update({name: gguf_slots(types, dev) for name, types in GGUF_FORMATS.items() if name in chosen})
    slot_of = torch.arange(E, dtype=torch.int32, device=dev)
    # --in-place: each format's slots copied once into page-locked host RAM, read over PCIe
    hosts = {name: slab.cpu().pin_memory() for name, (_, _, slab, _) in packed.items()} if args.in_place else {}
    report = {"device": torch.cuda.get_device_name(), "shipped": quant_pairs.QUANT_PAIR_CONFIGS,
              "shipped_gguf": GGUF_PAIR_CONFIG, "shipped_in_place": quant_pairs.QUANT_IN_PLACE_BLOCKS,
              "shipped_gguf_in_place": GGUF_IN_PLACE_BLOCKS, "pairs": [], "dequantize": []}
    for n in (int(t) for t in args.tokens.split(",")):
        p = n * K
        x = torch.randn(n, H, device=dev).to(torch.bfloat16)
        ids = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(n)]).reshape(-1) for _ in range(CALLS)]
        used = [torch.empty(p, dtype=torch.int32, device=dev) for _ in range(CALLS)]
        y = [torch.zeros(p, H, device=dev) for _ in range(CALLS)]
        base = None
        for name, (sw, blob, _, layout) in packed.items():
            refs = [reference(x, sw, slot_of, ids[i]) for i in range(CALLS)]
            if args.in_place:
                addrs = [host_addresses(hosts[name], slot_of, ids[i]) for i in range(CALLS)]
                configs = in_place_configs(layout.fmt.kind, args.sweep)
            else:
                quantized = isinstance(sw, QuantSlotWeights)
                configs = shipped_and_swept(layout.fmt.kind, p) if args.sweep and quantized else [None]
            rows = []
            for cfg in configs:
                if args.in_place:
                    calls = [partial(run_in_place, x, layout, addrs[i], y[i], cfg) for i in range(CALLS)]
                else:
                    calls = [partial(run_pairs, x, sw, slot_of, ids[i], y[i], used[i], cfg) for i in range(CALLS)]
                try:
                    us = graph_us(lambda i, calls=calls: calls[i](), CALLS)
                except Exception as e:  # noqa: BLE001 - a configuration Triton cannot build: skip it
                    print(f"{name} {cfg}: {type(e).__name__}")
                    continue
                rate = {"GBps": round(p * blob / us / 1e3, 2)} if args.in_place else {"TBps": round(p * blob / us / 1e6, 3)}
                rows.append({"config": cfg, "us": round(us, 2), **rate,
                             "rel_err": max(rel_err(y[i], refs[i]) for i in range(CALLS))})
            shipped, best = rows[0], min(rows, key=lambda r: r["us"])
            base = base or shipped["us"]
            rec = {"tokens": n, "pairs": p, "format": name, "in_place": args.in_place, "bytes_a_step": p * blob,
                   "shipped": shipped, "best": best, "speedup_vs_bf16": round(base / shipped["us"], 2), "all": rows}
            report["pairs"].append(rec)
            print(json.dumps({k: rec[k] for k in ("tokens", "format", "shipped", "best", "speedup_vs_bf16")}),
                  flush=True)
    for name, (sw, blob, _, _) in packed.items():
        if args.in_place or not isinstance(sw, QuantSlotWeights):
            continue
        every = list(range(E))
        dequantize_slots(sw, every, torch.bfloat16)  # built and warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dequantize_slots(sw, every, torch.bfloat16)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        moved = E * (blob + 3 * H * INTER * 2)
        rec = {"format": name, "experts": E, "ms": round(ms, 3), "GBps": round(moved / ms / 1e6, 1)}
        report["dequantize"].append(rec)
        print(json.dumps(rec), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_pairs.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

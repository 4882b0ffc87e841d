"""One model over several GPUs: how the cards are linked, and decode on 1 vs N cards at the same per-card budget.

    python bench/multigpu.py --model DIR [--gpus 0,1] [--budget 20GiB] [--tokens 64] [--out DIR]

Records, in multigpu.json under --out:
  topology   `nvidia-smi topo -m` as printed, and peer access between the listed cards (torch)
  h2d        pinned host -> GPU copy bandwidth per card alone, and with every listed card copying at once
  peer       GPU -> GPU copy bandwidth for each ordered pair of listed cards
  decode     the model decoding one stream on the first card alone, then split over all listed cards, each
             card with the same GPU expert budget (--budget, "a 24 GB card's worth" by default): tok/s, GPU
             hit rate, PCIe bytes per token per card, and the stage hops (activation copies between cards,
             timed with CUDA events on the copying stream) per token and as a share of the step time
Targets: 2 cards >= 1.6x one card's decode tok/s, 4 cards >= 2.5x, hops <= 5% of the step.
Decode samples at temperature 1 with a fixed seed so random-weight routing stays near uniform.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.*` when run as a script
from bench.decode_timing import timed_decode  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


def topology(gpus: list[int]) -> dict:
    from strata.runtime.plan.stages import link_kind

    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        text = f"nvidia-smi topo -m failed: {e}"
    links = {f"{a}->{b}": link_kind(a, b) for a in gpus for b in gpus if a != b}
    names = {i: torch.cuda.get_device_name(i) for i in gpus}
    return {"nvidia_smi_topo": text, "peer_access": links, "names": names}


def _timed_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> tuple[float, list[float]]:
    """Run every (dst, src) copy `repeats` times, all pairs concurrently (one stream per destination card);
    returns the wall seconds and each pair's seconds (CUDA events on its stream)."""
    streams = [torch.cuda.Stream(device=dst.device) for dst, _ in pairs]
    events = []
    for d in {dst.device for dst, _ in pairs}:
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for (dst, src), s in zip(pairs, streams, strict=True):
        with torch.cuda.stream(s):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s)
            for _ in range(repeats):
                dst.copy_(src, non_blocking=True)
            end.record(s)
            events.append((start, end))
    for _, end in events:
        end.synchronize()
    wall = time.perf_counter() - t0
    return wall, [start.elapsed_time(end) / 1000 for start, end in events]


def copy_bandwidth(gpus: list[int], nbytes: int, repeats: int = 8) -> dict:
    """Pinned -> GPU per card alone and all at once; GPU -> GPU per ordered pair (GB/s)."""
    hosts = {i: torch.empty(nbytes, dtype=torch.uint8).pin_memory() for i in gpus}
    dev = {i: torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in gpus}
    for i in gpus:  # warm-up (and peer-access enabling)
        dev[i].copy_(hosts[i], non_blocking=True)
    alone = {}
    for i in gpus:
        _, (s,) = _timed_copies([(dev[i], hosts[i])], repeats)
        alone[f"cuda:{i}"] = round(nbytes * repeats / s / 1e9, 2)
    wall, each = _timed_copies([(dev[i], hosts[i]) for i in gpus], repeats)
    together = {"total_GB_per_s": round(nbytes * repeats * len(gpus) / wall / 1e9, 2),
                "per_card_GB_per_s": {f"cuda:{i}": round(nbytes * repeats / s / 1e9, 2) for i, s in zip(gpus, each, strict=True)}}
    peer = {}
    for a in gpus:
        for b in gpus:
            if a != b:
                dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{b}")
                dst.copy_(dev[a])
                _, (s,) = _timed_copies([(dst, dev[a])], repeats)
                peer[f"cuda:{a}->cuda:{b}"] = round(nbytes * repeats / s / 1e9, 2)
                del dst
    return {"bytes_per_copy": nbytes, "h2d_alone_GB_per_s": alone, "h2d_together": together, "peer_GB_per_s": peer}


def decode(model: str, gpus: list[int], budget: str, tokens: int, numerics: str) -> dict:
    """Decode one stream with `gpus` (one card: plain single-device run) at `budget` per card."""
    from strata import Engine

    runtime = {"cpu_numerics": numerics, **({"devices": gpus} if len(gpus) > 1 else {"device": f"cuda:{gpus[0]}"})}
    cfg = {"runtime": runtime, "tiers": {"gpu": {"budget": budget}, "disk": {"scrub": False}}}
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, config=cfg)
    load_s = time.perf_counter() - t0
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(100 + i * 37) % vocab for i in range(128)]
    engine.generate(prompt, max_tokens=8, temperature=1.0, seed=1)  # warm-up: kernels, the CPU kernel
    time.sleep(3)  # let initial placement land
    engine.generate(prompt, max_tokens=8, temperature=1.0, seed=2)
    stage_map = getattr(engine.model, "stage_map", None)
    if stage_map is not None:
        stage_map.time_hops = True
        hops0 = stage_map.stats.snapshot()  # a fresh dict; reading it drains the pending timing events
    def sync() -> None:
        for i in gpus:
            torch.cuda.synchronize(i)

    run = timed_decode(engine, prompt, tokens, sync)  # the decode phase, statistics from the first token on
    before, after, n, dt = run.before["tiers"], run.after["tiers"], run.decode_tokens, run.decode_s
    result = {"cards": len(gpus), "budget_per_card": budget, "load_s": round(load_s, 2), "tokens": n,
              "decode_tok_per_s": round(n / dt, 3), "step_ms": round(1000 * dt / n, 3), "ttft_s": round(run.ttft_s, 3),
              "gpu_slots": engine.plan.tier("gpu").slots, "per_card": {}}
    graphs = engine.model.graphs
    if graphs is not None:  # hops inside replayed graphs are counted but not timed (timed: eager steps only)
        result["graph_replays"], result["graph_failures"] = graphs.replays, dict(graphs.failed)

    def card(b: dict, a: dict) -> dict:
        lookups = a["lookups"] - b["lookups"]
        gpu_hits = a["tiers"].get("gpu", {}).get("hits", 0) - b["tiers"].get("gpu", {}).get("hits", 0)
        pcie = sum(p["bytes"] for name, p in a["paths"].items() if name.endswith("->gpu")) - sum(
            p["bytes"] for name, p in b["paths"].items() if name.endswith("->gpu"))
        return {"gpu_hit_rate": round(gpu_hits / lookups, 4) if lookups else 0.0, "lookups": lookups,
                "pcie_bytes_per_token": pcie / n}

    result.update(card(before, after))
    if "devices" in after:
        result["per_card"] = {d: card(before["devices"][d], after["devices"][d]) for d in after["devices"]}
        result["stages"] = [g.layers for g in engine.plan.gpus]
    if stage_map is not None:
        hops = stage_map.stats.snapshot()
        hop_s = hops["seconds"] - hops0["seconds"]
        result["stage_hops"] = {"per_token": (hops["hops"] - hops0["hops"]) / n,
                                "bytes_per_token": (hops["bytes"] - hops0["bytes"]) / n,
                                "ms_per_token": round(1000 * hop_s / n, 4),
                                "share_of_step": round(hop_s / dt, 4)}
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint or store (e.g. `strata demo-model DIR --size bench`)")
    ap.add_argument("--gpus", default=None, help="cards to split over (default: every visible card)")
    ap.add_argument("--budget", default="20GiB", help="GPU expert budget per card (default 20GiB: a 24 GB card's worth)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--numerics", default="fork", choices=["fork", "gpu"], help="runtime.cpu_numerics")
    ap.add_argument("--copy-mib", type=int, default=1024, help="bytes per bandwidth copy, MiB")
    ap.add_argument("--skip-decode", action="store_true", help="only the link measurements")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    gpus = [int(x) for x in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
    if len(gpus) < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpus": gpus, "topology": topology(gpus), "copies": copy_bandwidth(gpus, args.copy_mib * MiB)}
    print(result["topology"]["nvidia_smi_topo"])
    print(json.dumps(result["copies"], indent=2), flush=True)
    if not args.skip_decode:
        runs = {}
        for cards in sorted({1, 2, len(gpus)}):
            runs[str(cards)] = decode(args.model, gpus[:cards], args.budget, args.tokens, args.numerics)
            print(json.dumps(runs[str(cards)]), flush=True)
        base = runs["1"]["decode_tok_per_s"]
        result["decode"] = runs
        result["speedup"] = {k: round(r["decode_tok_per_s"] / base, 3) for k, r in runs.items() if base}
    (out / "multigpu.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'multigpu.json'}")


if __name__ == "__main__":
    main()

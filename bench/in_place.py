"""Decode speed and start-up reads of a checkpoint served in place (its own safetensors) against its packed store.

    python bench/in_place.py --model DIR [--tokens 48] [--repeat 3] [--pinned-fraction 0.5] [--out FILE]

Both stores serve the same checkpoint on the CPU with the same budgets: no GPU, `tiers.pinned.budget` a fraction
(`--pinned-fraction`) of the routed experts' bytes, so the rest are read from the disk tier (O_DIRECT) as decode
asks for them. The packed store is built and the in-place index built and fully verified first (under a cache of
its own, `--cache`), so the timed runs measure an already-verified model. Then the two alternate, `--repeat`
times each, every run in a fresh process whose checkpoint and store files were first dropped from the page cache
(POSIX_FADV_DONTNEED): each run reports its start-up time and the bytes it read from storage while starting up
(/proc/self/io `read_bytes`, and `rchar` for reads served by the page cache), its greedy decode tok/s
(`Engine.stats()`, after a warm-up generation) and the tier statistics (pinned hits and evictions: experts that
came from disk). Prints JSON; `--out` writes it to a file.

`--reads N` measures the disk tier's read path alone instead (less sensitive to a loaded CPU): every expert read
once, in a shuffled order, through `DiskReader.read_parts` into one aligned slot, from the in-place store and
from the packed store in turn (N rounds each, alternating, page cache dropped before each), in MiB/s of slots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _io() -> dict[str, int]:
    """This process's I/O counters (/proc/self/io): read_bytes from storage, rchar through read calls."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k.strip()] = int(v)
    return out


def _drop_page_cache(*dirs: Path) -> None:
    """Evict the files under `dirs` from the page cache, so a run's start-up reads what it needs from storage."""
    for d in dirs:
        for f in d.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd) if os.access(f, os.W_OK) else None
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _config(mode: str, pinned_bytes: int) -> dict:
    return {"store": {"mode": mode}, "tiers": {"pinned": {"budget": str(pinned_bytes)}}}


def run_one(model: str, mode: str, pinned_bytes: int, tokens: int, prompt_tokens: int) -> dict:
    """One run in this process: load `model` with `[store] mode = mode`, warm up, time one greedy generation."""
    from strata import Engine

    io0, t0 = _io(), time.perf_counter()
    engine = Engine.from_pretrained(model, config=_config(mode, pinned_bytes), device="cpu")
    load_s, io1 = time.perf_counter() - t0, _io()
    vocab = engine.stats().get("vocab_size") or 4096
    warm = [(5 * i + 11) % min(vocab, 4000) + 3 for i in range(prompt_tokens)]
    engine.generate(warm, max_tokens=8, temperature=0.0, stop_token_ids=[])
    prompt = [(7 * i + 3) % min(vocab, 4000) + 3 for i in range(prompt_tokens)]
    before = engine.stats()
    out = engine.generate(prompt, max_tokens=tokens, temperature=0.0, stop_token_ids=[])
    after = engine.stats()
    decode_tokens = after["decode_tokens"] - before["decode_tokens"]
    decode_s = after["decode_seconds"] - before["decode_seconds"]
    tiers = after["tiers"] or {}
    engine.close()
    return {"mode": mode, "load_s": load_s, "startup_read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "startup_rchar": io1["rchar"] - io0["rchar"], "tokens": len(out.token_ids),
            "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0, "token_ids": list(out.token_ids),
            "tiers": {"lookups": tiers.get("lookups"), "misses": tiers.get("misses"),
                      "per_tier": tiers.get("tiers"), "checksum_failures": tiers.get("checksum_failures")}}


def _prepare(model: str, pinned_bytes: int) -> dict:
    """Build the packed store and the in-place index, verify the in-place parts fully; the sizes involved."""
    from strata import Engine
    from strata.config import load_config
    from strata.runtime.plan.checkpoints.in_place import open_in_place

    for mode in ("packed", "in_place"):
        Engine.from_pretrained(model, config=_config(mode, pinned_bytes), device="cpu").close()
    store = open_in_place(model, load_config(_config("in_place", pinned_bytes)))
    damaged = store.verify()
    verified, total = store.verification_progress()
    expert_bytes = sum(p.length for parts in store.index.blobs.values() for p in parts)
    store.close()
    return {"damaged": damaged, "verified_bytes": verified, "part_bytes": total, "expert_bytes": expert_bytes}


def read_rounds(model: str, cache: str, rounds: int) -> dict:
    """MiB/s of expert slots read from disk through `DiskReader.read_parts`, per round, in place and packed."""
    import random

    from strata.config import load_config
    from strata.runtime.plan.checkpoints.in_place import open_in_place
    from strata.runtime.plan.checkpoints.store_cache import store_root
    from strata.tiers.storage.diskio import DiskReader, aligned_empty
    from strata.tiers.store.format import is_store
    from strata.tiers.store.store import ExpertStore

    in_place = open_in_place(model, load_config({}))
    packed = ExpertStore.open(next(d for d in store_root(load_config({})).iterdir() if is_store(d)))
    keys = list(packed.keys())
    random.Random(0).shuffle(keys)
    stores = {"in_place": in_place, "packed": packed}
    rates: dict[str, list[float]] = {"in_place": [], "packed": []}
    with DiskReader() as reader:
        for i in range(rounds):
            for mode in (("in_place", "packed") if i % 2 == 0 else ("packed", "in_place")):
                _drop_page_cache(Path(model), Path(cache))
                store = stores[mode]
                slot = aligned_empty(store.slot_bytes)
                t0 = time.perf_counter()
                for key in keys:
                    reader.read_parts(store.extents(key), slot).result()
                rates[mode].append(len(keys) * store.slot_bytes / (time.perf_counter() - t0) / 2**20)
    return {"experts": len(keys), "slot_bytes": packed.slot_bytes,
            "extents_per_expert": len(in_place.extents(keys[0])), "mib_s": rates}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (safetensors)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--pinned-fraction", type=float, default=0.5, help="pinned budget as a fraction of expert bytes")
    p.add_argument("--cache", default="/tmp/strata-bench-in-place", help="STRATA_CACHE for both stores")
    p.add_argument("--out", default=None, help="file for the JSON result")
    p.add_argument("--reads", type=int, default=0, metavar="N", help="N rounds of the read path alone")
    p.add_argument("--child", nargs=2, metavar=("MODE", "PINNED_BYTES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ["STRATA_CACHE"] = args.cache

    if args.child:  # one timed run, in a fresh process
        print(json.dumps(run_one(args.model, args.child[0], int(args.child[1]), args.tokens, args.prompt_tokens)))
        return 0

    if args.reads:  # the stores must exist: run the decode comparison first
        result = {"model": args.model, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                  "load_avg": os.getloadavg(), "reads": read_rounds(args.model, args.cache, args.reads)}
        print(json.dumps(result))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        return 0

    from strata.runtime.model.checkpoint import Checkpoint

    ckpt = Checkpoint.open(args.model)
    routed = [t for t in ckpt.index if ".experts." in t.name and ".shared_experts." not in t.name]
    expert_bytes = sum(t.nbytes for t in routed)
    weight_bytes = sum(t.nbytes for t in ckpt.index)
    pinned_bytes = int(expert_bytes * args.pinned_fraction)
    prep = _prepare(args.model, pinned_bytes)
    runs = []
    for i in range(args.repeat):
        for mode in (("in_place", "packed") if i % 2 == 0 else ("packed", "in_place")):
            _drop_page_cache(Path(args.model), Path(args.cache))
            cmd = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens), "--prompt-tokens",
                   str(args.prompt_tokens), "--cache", args.cache, "--child", mode, str(pinned_bytes)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("token_ids", "tiers")}), file=sys.stderr)

    def median(mode: str, key: str) -> float:
        xs = sorted(r[key] for r in runs if r["mode"] == mode)
        return xs[len(xs) // 2]

    summary = {m: {k: median(m, k) for k in ("decode_tok_s", "load_s", "startup_read_bytes", "startup_rchar")}
               for m in ("in_place", "packed")}
    summary["in_place_over_packed"] = summary["in_place"]["decode_tok_s"] / summary["packed"]["decode_tok_s"]
    # each round's two runs back to back: their ratio cancels the machine's drift between rounds (a shared disk and
    # memory bus moved one mode's rate 2.5x within minutes here), which the medians above do not
    pairs = [runs[i]["decode_tok_s"] / runs[i + 1]["decode_tok_s"] if runs[i]["mode"] == "in_place"
             else runs[i + 1]["decode_tok_s"] / runs[i]["decode_tok_s"] for i in range(0, len(runs) - 1, 2)]
    summary["round_ratios"] = pairs
    summary["round_ratio_median"] = statistics.median(pairs) if pairs else None
    summary["same_tokens"] = len({tuple(r["token_ids"]) for r in runs}) == 1
    result = {"model": args.model, "weight_bytes": weight_bytes, "expert_bytes": expert_bytes,
              "pinned_budget_bytes": pinned_bytes, "prepare": prep, "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "summary": summary,
              "runs": runs}
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

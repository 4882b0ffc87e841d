"""What the GPU does between a split decode layer's answer and the next layer's post (the serial phase), kernel
by kernel, beside the same kernels in the all-in-VRAM step: CUPTI's kernel records (torch.profiler) of a few
decode steps replayed as CUDA graphs.

    python bench/tools/serial_phase.py --model DIR [--gpu-fraction 0.25] [--tokens 24] [--cases split,ceiling]
                                       [--out DIR]

Cases: split, ceiling; `+nowarm` (split without warm-ahead: debug.warm_ahead = false). First a probe:
a `wait_and_fetch` whose answer is already there, the handshake's floor on the GPU's side. Each split case also
gives the worker's own serve and gap a layer over the profiled tokens, and three layers' raw kernel records
(`raw_layers`).

A split layer's cycle is cut at its kernels that talk to the mailbox worker: `_pack_kernel` posts the layer (its
end: the inbox written), and the answer's copy (`_read_kernel` after the one-warp `_acquire_kernel`; in traces of
older code, the one `_fetch_kernel`) ends with the answer on the GPU. The serial phase runs from one
answer to the next pack's end; the cold phase from a pack's end to the answer (`cold_gpu_work_us`: from the
pack's end to the last end of the GPU's own kernels in it, the resident pairs and the in-place share). The
ceiling's cycle is cut at its router kernel. For each case: median phase lengths (us), and for the serial phase
the kernels in order with their median duration and the median idle time before each (start minus the latest end
of anything before it on any stream; negative: overlapped, as programmatic dependent launch allows). CUPTI adds a
little time a kernel: read the gaps against each other, not as absolute launch costs.
Writes serial_phase.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PACK, FETCH, ROUTER = "_pack_kernel", ("_fetch_kernel", "_read_kernel"), "_route_kernel"  # fetch: one kernel, or the copy


def has(name: str, mark: str | tuple[str, ...]) -> bool:
    """Whether a kernel's name holds the mark (or one of the marks)."""
    return any(m in name for m in ((mark,) if isinstance(mark, str) else mark))


def kernel_records(trace: dict) -> list[tuple[str, float, float, int]]:
    """(name, start us, end us, stream) of every GPU kernel in a chrome trace, by start."""
    out = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(e.get("args", {}).get("stream", 0)))
           for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    return sorted(out, key=lambda r: r[1])


def profiled_kernels(prof) -> list[tuple[str, float, float, int]]:
    """`kernel_records` of a finished torch.profiler run (through its chrome trace)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return kernel_records(json.loads(Path(f.name).read_text()))


def short(name: str) -> str:
    """A kernel's name without its template arguments and launch-configuration suffixes."""
    name = name.split("<")[0].split("(")[0]
    return name if len(name) <= 60 else name[:57] + "..."


def cycles(kernels: list[tuple[str, float, float, int]], start_mark: str | tuple[str, ...], end_mark: str | tuple[str, ...]
           ) -> list[list[tuple[str, float, float, int]]]:
    """Kernel runs from each `start_mark` kernel (included) to the next `end_mark` kernel (included)."""
    runs, cur = [], None
    for k in kernels:
        if cur is not None and has(k[0], end_mark):
            runs.append(cur + [k])
            cur = None
        if has(k[0], start_mark):
            cur = [k]
        elif cur is not None:
            cur.append(k)
    return runs


def sequences(runs: list[list[tuple[str, float, float, int]]]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Each run's kernel names in order, and the commonest such sequence."""
    seqs = [tuple(short(k[0]) for k in r) for r in runs]
    return seqs, max(set(seqs), key=seqs.count)


def gpu_work_us(cold: list[list[tuple[str, float, float, int]]]) -> list[float]:
    """Each cold phase's own GPU work: from the pack's end to the last end of its kernels but the wait for the
    worker (the acquire) and the answer's copy."""
    return [max((k[2] for k in r[1:-1] if "_acquire_kernel" not in k[0]), default=r[0][2]) - r[0][2] for r in cold]


def serial_table(runs: list[list[tuple[str, float, float, int]]]) -> dict:
    """Median length of the runs (first kernel's end to last kernel's end) and, position by position over the runs
    of the commonest kernel sequence, each kernel's median duration and the idle time before it."""
    if not runs:
        return {"runs": 0}
    seqs, common = sequences(runs)
    same = [r for r, s in zip(runs, seqs, strict=True) if s == common]
    rows = []
    for i, name in enumerate(common):
        durs = [r[i][2] - r[i][1] for r in same]
        idle = [r[i][1] - max(k[2] for k in r[:i]) for r in same] if i else [0.0]
        rows.append({"kernel": name, "stream": same[0][i][3], "dur_us": round(statistics.median(durs), 2),
                     "idle_before_us": round(statistics.median(idle), 2)})
    length = [r[-1][2] - r[0][2] for r in runs]
    busy = sum(r["dur_us"] for r in rows[1:])
    return {"runs": len(runs), "same_sequence": len(same), "length_us": round(statistics.median(length), 1),
            "kernel_us": round(busy, 1), "idle_us": round(sum(r["idle_before_us"] for r in rows[1:]), 1),
            "kernels": rows}


def profile_case(model: str, cfg: dict, tokens: int) -> list[tuple[str, float, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    from bench.tools.hotpath import wait_for_placement
    from strata import Engine

    engine = Engine.from_pretrained(model, config=cfg, device="cuda")
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(100 + i * 37) % vocab for i in range(128)]
    engine.generate(prompt, max_tokens=8, temperature=1.0, seed=1)
    if engine.tiers is not None:
        wait_for_placement(engine.tiers)
        engine.generate(prompt, max_tokens=16, temperature=1.0, seed=2)
    torch.cuda.synchronize()
    box = getattr(engine.executor, "mailbox", None)
    t0 = box.timing()["totals"] if box is not None else None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, max_tokens=tokens, temperature=1.0, seed=3, stop_token_ids=[])
        torch.cuda.synchronize()
    worker = box.window(t0, box.timing()["totals"]) if box is not None else None  # the worker's clock, same tokens
    kernels = profiled_kernels(prof)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return kernels, worker


def raw_layers(kernels: list[tuple[str, float, float, int]], first: int = 100, layers: int = 3) -> list[list]:
    """Every kernel from the `first`-th fetch kernel's start through the next `layers` layers: [name, stream, start
    us, end us] relative to that fetch's end (a reader's timeline of a few split layers)."""
    marks = [i for i, k in enumerate(kernels) if has(k[0], FETCH)]
    if len(marks) <= first + layers:
        return []
    lo, hi = marks[first], marks[first + layers]
    t = kernels[lo][2]
    return [[short(k[0]), k[3], round(k[1] - t, 2), round(k[2] - t, 2)] for k in kernels[lo : hi + 1]]


def fetch_probe(calls: int = 64, floats: int = 2048) -> dict:
    """us a `wait_and_fetch` takes when the worker has already answered (done = the generation), `calls` of them
    replayed in one CUDA graph: the handshake's floor on the GPU's side."""
    from bench.probes.fetch_probe import answered, timed  # (Triton kernels at import: the GPU box only)
    from strata.kernels.gpu.host_signal import wait_and_fetch

    header, gen, src, out = answered(floats)
    us = timed(lambda: wait_and_fetch(header, gen, src, out), calls)
    return {"fetch_us": us, "floats": floats, "same": bool(torch.equal(out.cpu(), src))}


def spread(cold: list[list[tuple[str, float, float, int]]]) -> dict:
    """How the cold phases spread (the worker's clock averages them; a few long ones move its means): the
    percentiles of the phase's length, of the GPU's own cold work in it (pack end to its last kernel's end) and of
    the wait for the worker after that (the acquire kernel's length), and the share of layers where that wait was
    under 3 us, i.e. the answer was (nearly) there when the GPU came for it."""
    if not cold:
        return {}
    pick = lambda xs, q: round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 1)  # noqa: E731
    length = [r[-1][2] - r[0][2] for r in cold]
    work = gpu_work_us(cold)
    wait = [next((k[2] - k[1] for k in r if "_acquire_kernel" in k[0]), 0.0) for r in cold]
    out = {name: {f"p{int(q * 100)}": pick(xs, q) for q in (0.1, 0.5, 0.9)} | {"mean": round(statistics.fmean(xs), 1)}
           for name, xs in (("length_us", length), ("gpu_work_us", work), ("acquire_us", wait))}
    out["answer_there"] = round(sum(w < 3.0 for w in wait) / len(wait), 3)
    return out


def step_ends(runs: list[list[tuple[str, float, float, int]]]) -> dict:
    """The serial phases that cross a step's end (the last layer's answer to the next step's first post: the LM
    head, sampling, the next step's launch and its first attention), told from the layers' own by their kernel
    sequence: their median length and, for their commonest sequence, each kernel with the idle time before it (a
    large idle: the GPU waited for the host's launch)."""
    if not runs:
        return {}
    seqs, common = sequences(runs)
    ends = [r for r, q in zip(runs, seqs, strict=True) if len(q) > len(common)]
    if not ends:
        return {"runs": 0}
    table = serial_table(ends)
    gaps = [max(0.0, r[i][1] - max(k[2] for k in r[:i])) for r in ends for i in range(1, len(r))]
    table["idle_positive_us"] = round(sum(gaps) / len(ends), 1)  # the GPU idle in such a phase, summed
    return table


def analyse(name: str, kernels: list[tuple[str, float, float, int]], worker: dict | None = None) -> dict:
    """The phases of a case's decode layers from its kernel records (`worker`: the mailbox worker's own per-layer
    serve and gap over the same tokens)."""
    if any(has(k[0], PACK) for k in kernels):
        runs = cycles(kernels, FETCH, PACK)
        serial = serial_table(runs)
        cold = cycles(kernels, PACK, FETCH)
        cold_len = [r[-1][2] - r[0][2] for r in cold]
        fetch_wait = [r[-1][2] - r[-1][1] for r in cold]
        gpu_work = gpu_work_us(cold)
        med = lambda xs: round(statistics.median(xs), 1) if xs else None  # noqa: E731
        return {"case": name, "worker": worker, "serial": serial, "cold_us": med(cold_len),
                "fetch_kernel_us": med(fetch_wait), "cold_gpu_work_us": med(gpu_work), "cold": serial_table(cold),
                "spread": spread(cold), "step_ends": step_ends(runs), "raw_layers": raw_layers(kernels)}
    return {"case": name, "layer": serial_table(cycles(kernels, ROUTER, ROUTER))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--cases", default="split,ceiling")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    from bench.tools.step_timeline import case_configs

    cfgs = case_configs(args.model, args.gpu_fraction, "/dev/shm/strata-cache")
    for case in args.cases.split(","):  # before the probe: a typo costs no GPU time
        base, *mods = case.split("+")
        if base not in cfgs or set(mods) - {"nowarm"}:
            raise SystemExit(f"unknown case {case!r}; use split or ceiling, optionally with +nowarm")
    results = [fetch_probe()]
    print(results[0], flush=True)
    for case in args.cases.split(","):
        base, *mods = case.split("+")
        cfg = cfgs[base]
        if "nowarm" in mods:  # warm-ahead off: the worker spins through the serial phase
            cfg = {**cfg, "debug": {"warm_ahead": False}}
        res = analyse(case, *profile_case(args.model, cfg, args.tokens))
        print(json.dumps(res, indent=1), flush=True)
        results.append(res)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "serial_phase.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

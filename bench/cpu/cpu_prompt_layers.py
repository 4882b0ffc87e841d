"""The CPU expert kernel on a prompt pass's layer calls, where every expert of the layer has a few tokens, per knob set.

    python bench/cpu/cpu_prompt_layers.py [--tokens 1,8,32,64] [--knobs "down_stream=0;down_stream=131072"] [--rounds 5]
                                          [--seconds 1.0] [--layers 2] [--threads N] [--out DIR]
    python bench/cpu/cpu_prompt_layers.py --tokens 128,512,1024 --knobs "plain_max=64;plain_max=10"
    python bench/cpu/cpu_prompt_layers.py --experts q4_k --tokens 64,128,256,512 --knobs "quant_max=64;quant_max=12"
    python bench/cpu/cpu_prompt_layers.py --tokens 64,128 --knobs "prefetch=0;prefetch=2048"

A decode step's layer call holds its top-k experts (8 for one token); a prompt's holds nearly every expert of the
layer, each with the few of its tokens routed to it (64 tokens, top-8 of 128: ~4 each). The second reads the same
number of bytes an expert in many more, shorter runs (one a row range of each expert), which is what the kernel's
down-phase chunking is about (csrc/cpu_experts.cpp, `strata_cpu_tune`'s down_stream). This times the kernel
(`cpu_experts_forward`, bf16, the bench model's expert: H 2048, I 768, 128 experts, top-8, uniform random routing)
on `--layers` distinct layers of experts (cycled, so the weights come from RAM, not the caches) for each token count
and knob set, the knob sets alternated over `--rounds` rounds, each case's best round kept, every knob set's output
checked bit-identical to the first's. A knob set may hold `plain_max=N`: the most tokens a plain expert keeps on the
kernel before torch's bf16 GEMMs take it (`experts.plain_max_tokens`, replaced for that set; outputs across
different values checked within the avx512_bf16 bound instead), and `prefetch=N`: the kernel's software prefetch
distance along a row in bytes (`library.configure(prefetch_bytes=)`; unset: the distance in force). `--experts` q4_k,
q6_k, q8_0, fp8 or mxfp4: the layers' experts in that format (one random quantized expert copied into each), and a
knob set may hold `quant_max=N`: the most tokens a quantized expert keeps on the kernel before it is dequantized for
torch's GEMMs (`experts.quant_max_tokens`; its max_tokens, 64: never); `--even` gives every expert the same token
count (tokens * 8 / 128), to time one count; `--dequant-rate q4_k,fp8,...` times the compiled dequantizer instead (an
expert's gate_up, 1 and 2 threads: ms, Mvalues/s, GB/s of bf16 written; cpu_dequant_rate.json). Prints ms a layer,
GB/s (the experts' bytes a call reads / its time) and each knob set against the first; writes cpu_prompt_layers.json
into --out. Runs on any x86-64 machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script
from bench.cpu.cpu_experts import FORMATS, gguf_blocks, machine  # noqa: E402
from bench.provenance import write_record  # noqa: E402
from strata.kernels.cpu import experts as ce  # noqa: E402
from strata.kernels.cpu import library  # noqa: E402
from strata.kernels.cpu.tuning import parse_knobs  # noqa: E402
from strata.kernels.quant import ExpertLayout  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # the bench model's MoE layer (Qwen3-30B-A3B)


def make_layers(layers: int, hidden: int, inter: int, experts: int, seed: int = 0) -> list[list[tuple]]:
    """`layers` lists of `experts` bf16 experts (gate_up [2I, H], down [H, I]), each its own buffer, distinct."""
    g = torch.Generator().manual_seed(seed)
    per = 3 * inter * hidden
    block = (torch.randn(per + 4096, generator=g) * 0.02).to(torch.bfloat16)
    out = []
    for layer in range(layers):
        ws = []
        for e in range(experts):
            blob = torch.empty(per, dtype=torch.bfloat16)
            off = ((layer * experts + e) * 977) % 4096
            blob.copy_(block[off: off + per])
            ws.append((blob[: 2 * inter * hidden].view(2 * inter, hidden), blob[2 * inter * hidden:].view(hidden, inter)))
        out.append(ws)
    return out


def make_quant_layers(layers: int, hidden: int, inter: int, experts: int, fmt: str, seed: int = 0) -> list[list[tuple]]:
    """`layers` lists of `experts` quantized experts of `fmt` (QuantMatrix pairs), each its own blob (one random expert
    copied: the kernel's and the dequantizer's rates do not depend on the values)."""
    layout = ExpertLayout.build(FORMATS[fmt], hidden, inter)
    g = torch.Generator().manual_seed(seed)
    if layout.fmt.kind == "gguf":
        one = layout.pack_gguf(*(gguf_blocks(layout.fmt.ggml[j][0], rows, k, g)
                                 for j, (rows, k) in enumerate(((inter, hidden), (inter, hidden), (hidden, inter)))))
    else:
        one = layout.pack(torch.randn(2 * inter, hidden, generator=g) * 0.02,
                          torch.randn(hidden, inter, generator=g) * 0.02)
    return [[layout.matrices(one.clone()) for _ in range(experts)] for _ in range(layers)]


def routing(tokens: int, experts: int, top_k: int, seed: int = 0,
            even: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Uniform random top-k routing of `tokens` tokens: per expert, its token rows and their weights (1 / top_k);
    `even`: every expert tokens * top_k / experts of them (a multiple of experts / top_k tokens), to time one count."""
    g = torch.Generator().manual_seed(seed + tokens)
    if even:
        perm = torch.randperm(experts, generator=g)
        ids = perm[(torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)) % experts]
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    idx = [torch.nonzero((ids == e).any(1)).flatten() for e in range(experts)]
    return idx, [torch.full((len(i),), 1.0 / top_k) for i in idx]


def split_knobs(text: str) -> tuple[dict[str, int], int | None, int | None]:
    """One --knobs set: the kernel's knobs; plain_max or quant_max (None: the engine's own `plain_max_tokens`,
    `quant_max_tokens`; which of the two applies: the layers' format); and prefetch, the software prefetch distance in
    bytes (`library.configure(prefetch_bytes=)`; None: the distance in force)."""
    parts = [p for p in text.split(",") if p.strip()]
    named = {p.split("=")[0].strip(): int(p.split("=")[1]) for p in parts
             if p.split("=")[0].strip() in ("plain_max", "quant_max", "prefetch")}
    rest = [p for p in parts if p.split("=")[0].strip() not in named]
    knobs = parse_knobs(",".join(rest), "--knobs") if rest else {}
    return knobs, named.get("plain_max", named.get("quant_max")), named.get("prefetch")


@contextmanager
def handing_off_at(plain_max: int | None):
    """Inside: plain experts of more than `plain_max` tokens go to torch's GEMMs, and quantized ones, dequantized
    (`experts.plain_max_tokens` and `quant_max_tokens` replaced; None: as shipped)."""
    shipped = ce.plain_max_tokens, ce.quant_max_tokens
    if plain_max is not None:
        ce.plain_max_tokens = ce.quant_max_tokens = lambda backend, *args, **kwargs: plain_max
    try:
        yield
    finally:
        ce.plain_max_tokens, ce.quant_max_tokens = shipped


def forward(x, layer, idx, w, threads, plain_max: int | None):
    """`cpu_experts_forward` with plain experts of more than `plain_max` tokens on torch's GEMMs (None: as shipped)."""
    with handing_off_at(plain_max):
        return ce.cpu_experts_forward(x, layer, idx, w, threads=threads)


def expert_bytes(gate_up, down) -> int:
    """Bytes of an expert's weights as the kernel reads them (a quantized one: its values and scales)."""
    if isinstance(gate_up, torch.Tensor):
        return (gate_up.numel() + down.numel()) * 2
    return sum(t.numel() * t.element_size() for m in (gate_up, down) for t in (m.values, m.scales))


def measure(layers: list, tokens: int, knob_sets: list[tuple[dict[str, int], int | None, int | None]], rounds: int,
            seconds: float, threads: int | None, saved: dict[str, int], hidden: int = HIDDEN, kind: str = "plain",
            even: bool = False) -> dict:
    """Best ms a layer per knob set (alternated over rounds) for one token count, outputs checked bit-identical
    (within the avx512_bf16 bound across plain_max values); each knob's value before its first setting kept in
    `saved`, the prefetch distance in force before set again at the end."""
    idx, w = routing(tokens, len(layers[0]), TOP_K, even=even)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    used = [e for e, i in enumerate(idx) if i.numel()]
    nbytes = sum(expert_bytes(*layers[0][e]) for e in used)
    refs: dict[int | None, torch.Tensor] = {}
    times: list[list[float]] = [[] for _ in knob_sets]
    distance = library.prefetch_bytes()  # the distance in force, set again at the end
    try:
        for _ in range(rounds):
            for k, (knobs, plain_max, prefetch) in enumerate(knob_sets):
                for name, before in ce.tune(**knobs).items():
                    saved.setdefault(name, before)
                library.configure(prefetch_bytes=distance if prefetch is None else prefetch)
                out = forward(x, layers[0], idx, w, threads, plain_max)
                first = next(iter(refs.values()), out)
                if (ref := refs.setdefault(plain_max, out)) is not out and not torch.equal(out, ref):
                    raise SystemExit(f"knobs {knobs} changed the kernel's output at {tokens} tokens")
                if (out - first).abs().max() / first.abs().max() > ce.tolerance("avx512_bf16", kind):
                    raise SystemExit(f"plain_max={plain_max} moved the output past bf16's bound at {tokens} tokens")
                calls, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    forward(x, layers[calls % len(layers)], idx, w, threads, plain_max)
                    calls += 1
                times[k].append((time.perf_counter() - t0) / calls * 1e3)
    finally:
        library.configure(prefetch_bytes=distance)
    cases = []
    for (knobs, plain_max, prefetch), ms in zip(knob_sets, times, strict=True):
        best = min(ms)
        hand = {"plain_max" if kind == "plain" else "quant_max": plain_max} if plain_max is not None else {}
        hand |= {"prefetch": prefetch} if prefetch is not None else {}
        cases.append({"knobs": knobs | hand, "ms": round(best, 3), "gbps": round(nbytes / best / 1e6, 2),
                      "rounds_ms": [round(t, 3) for t in ms], "vs_first": round(min(times[0]) / best, 3)})
    return {"tokens": tokens, "experts_used": len(used), "bytes": nbytes, "cases": cases}


def dequant_rates(fmts: list[str], seconds: float = 0.3, rounds: int = 3) -> list[dict]:
    """The compiled dequantizer's rate (strata.kernels.cpu.dequant) on one expert's gate_up of each format, on 1 and 2
    threads: best ms of `rounds`, Mvalues/s and GB/s of bf16 written."""
    from strata.kernels.cpu import dequant

    out = []
    for fmt in fmts:
        gate_up, _ = make_quant_layers(1, HIDDEN, INTER, 1, fmt)[0][0]
        w = torch.empty(gate_up.shape, dtype=torch.bfloat16)
        for threads in (1, 2):
            dequant.dequantize(gate_up, w, threads=threads)
            best = float("inf")
            for _ in range(rounds):
                calls, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    dequant.dequantize(gate_up, w, threads=threads)
                    calls += 1
                best = min(best, (time.perf_counter() - t0) / calls)
            out.append({"experts": fmt, "threads": threads, "values": w.numel(), "ms": round(best * 1e3, 3),
                        "mvalues_s": round(w.numel() / best / 1e6), "gbps_bf16": round(2 * w.numel() / best / 1e9, 2)})
            print(f"dequantize {fmt:6s} [{w.shape[0]}, {w.shape[1]}] on {threads} thread(s): {best * 1e3:.3f} ms, "
                  f"{out[-1]['mvalues_s']} Mvalues/s, {out[-1]['gbps_bf16']} GB/s of bf16", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,32,64", help="comma-separated token counts of a layer call")
    ap.add_argument("--knobs", default="down_stream=0;down_stream=131072",
                    help="';'-separated knob sets (strata.kernels.cpu.tuning.TUNE_KEYS), the first the baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds a case a round")
    ap.add_argument("--layers", type=int, default=2, help="distinct layers of experts cycled (2: 2.4 GB)")
    ap.add_argument("--experts", default="bf16", help="the experts' format: bf16, q4_k, q6_k, q8_0, fp8, mxfp4")
    ap.add_argument("--even", action="store_true", help="every expert the same token count (tokens * 8 / 128)")
    ap.add_argument("--dequant-rate", default="", help="comma-separated formats: time the compiled dequantizer on "
                    "them (1 and 2 threads) instead of layer calls")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: the kernel's default)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    if ce.library() is None:
        raise SystemExit("the compiled CPU expert kernel is not available on this machine (strata.kernels.cpu.build)")
    if args.dequant_rate:
        rates = dequant_rates(args.dequant_rate.split(","))
        write_record(args.out, "cpu_dequant_rate.json", "cpu/cpu_prompt_layers --dequant-rate",
                     "bench/cpu/cpu_prompt_layers.py", None, torch_gemms_on_amx=ce.torch_gemms_on_amx(), rates=rates)
        return
    knob_sets = [split_knobs(s) for s in args.knobs.split(";") if s.strip()]
    saved: dict[str, int] = {}
    if args.experts == "bf16":
        layers = make_layers(args.layers, HIDDEN, INTER, EXPERTS)
    else:
        layers = make_quant_layers(args.layers, HIDDEN, INTER, EXPERTS, args.experts)
    kind = FORMATS[args.experts].kind
    result = {"machine": machine(), "experts": args.experts, "backend": ce.backend(None, FORMATS[args.experts]),
              "threads": args.threads or ce.default_threads(),
              "torch_gemms_on_amx": ce.torch_gemms_on_amx(),
              "shape": {"hidden": HIDDEN, "inter": INTER, "experts": EXPERTS, "top_k": TOP_K}, "calls": []}
    try:
        for tokens in (int(t) for t in args.tokens.split(",")):
            res = measure(layers, tokens, knob_sets, args.rounds, args.seconds, args.threads, saved, kind=kind,
                          even=args.even)
            result["calls"].append(res)
            for c in res["cases"]:
                print(f"{tokens:4d} tokens ({res['experts_used']:3d} experts) {c['knobs']}: {c['ms']:8.2f} ms a layer, "
                      f"{c['gbps']:6.1f} GB/s, x{c['vs_first']:.2f}", flush=True)
    finally:
        ce.tune(**saved)
    write_record(args.out, "cpu_prompt_layers.json", "cpu/cpu_prompt_layers", "bench/cpu/cpu_prompt_layers.py", None,
                 even=args.even, **result)


if __name__ == "__main__":
    main()

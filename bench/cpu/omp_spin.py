"""torch's OpenMP workers against the CPU kernel's pool: prefill and a traced layer call under environment settings
that libgomp reads when torch loads, in alternated processes.

    python bench/cpu/omp_spin.py --model STORE [--env "" "GOMP_SPINCOUNT=1000"] [--prompt 64 512] [--reps 8]
                                 [--rounds 6] [--layer-tokens 64] [--threads 2] [--out DIR]

A prompt pass on a CPU-only host alternates torch's parallel ops (oneDNN's GEMMs, elementwise chains: OpenMP teams)
with the CPU kernel's own thread pool (the routed experts, the LM head). After each parallel op libgomp's idle workers
spin, by default for about 300,000 pause loops, on cores the pool's threads then wait for. Each environment set
(`--env`, space-separated NAME=VALUE pairs, "" for the inherited environment) runs in a process of its own, the sets
alternated (their order reversed every other round) over `--rounds` rounds. A process loads the engine
(`Engine.from_pretrained(device="cpu")`, `--threads` for both torch and the kernel), times `--reps` prefills of each
`--prompt` length (a fresh prompt each, `generate(max_tokens=1)`) after two untimed ones, then one traced kernel call:
a `--layer-tokens`-token layer of the bench model's experts (bench/cpu/cpu_prompt_layers.py's) right after a parallel
torch op on this thread, 20 calls, with the kernel's phase trace (`library.trace`): how late its last pool thread
joins, the call's time and its two phases. Prints each process's line and the medians of each set; writes
omp_spin.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root, when run as a script
from bench.provenance import write_record  # noqa: E402


def parse_env(text: str) -> dict[str, str]:
    """'A=1 B=2' -> {'A': '1', 'B': '2'}; '' -> {} (the inherited environment)."""
    pairs = [p for p in text.split() if p]
    bad = [p for p in pairs if "=" not in p or not p.split("=", 1)[0]]
    if bad:
        raise SystemExit(f"--env: {bad[0]!r} is not NAME=VALUE")
    return dict(p.split("=", 1) for p in pairs)


def child(args: argparse.Namespace) -> dict:
    """One process's measurements (run with the set's environment already in place)."""
    import torch

    from bench.cpu.cpu_prompt_layers import forward, make_layers, routing
    from bench.cpu.strata_cpu_side import engine_config
    from strata import Engine
    from strata.kernels.cpu import library

    engine = Engine.from_pretrained(args.model, config=engine_config(args.threads, 1, max(args.prompt) + 64, "auto",
                                                                      False), device="cpu")
    engine.wait_settled()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.checkpoint.config.vocab_size
    names = {name for text in args.env for name in parse_env(text)}
    out: dict = {"env_seen": {name: os.environ.get(name) for name in sorted(names)}, "prefill_tok_s": {}}
    for n in args.prompt:
        times = []
        for i in range(args.reps + 2):
            prompt = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
            t0 = time.perf_counter()
            engine.generate(prompt, max_tokens=1)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out["prefill_tok_s"][n] = round(n / statistics.median(times), 1)
    if args.layer_tokens:
        layers = make_layers(2, 2048, 768, 128)
        idx, w = routing(args.layer_tokens, 128, 8)
        x = torch.randn(args.layer_tokens, 2048)
        for i in range(4):
            forward(x, layers[i % 2], idx, w, args.threads, None)
        library.trace(True)
        calls = 20
        for i in range(calls):
            torch.randn(1 << 20).exp_()  # a parallel op on this thread, as attention's before a layer's experts
            forward(x, layers[i % 2], idx, w, args.threads, None)
        tr = library.trace(False)
        out["layer_call_us"] = {k: round(tr[k] / calls / 1e3, 1) for k in ("call_ns", "last_arrival_ns", "phase1_ns",
                                                                             "phase2_ns")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint or store directory")
    ap.add_argument("--env", nargs="+", default=["", "GOMP_SPINCOUNT=1000"],
                    help='environment sets, each "NAME=VALUE ..." ("": as inherited)')
    ap.add_argument("--prompt", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--reps", type=int, default=8, help="timed prefills of each length a process")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layer-tokens", type=int, default=64, help="tokens of the traced layer call (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    sets = [(text, parse_env(text)) for text in args.env]
    runs: list[dict] = []
    argv = sys.argv[1:]
    for r in range(args.rounds):
        for text, env in sets if r % 2 == 0 else sets[::-1]:
            proc = subprocess.run([sys.executable, __file__, *argv, "--child"], env={**os.environ, **env},
                                  capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise SystemExit(f"omp_spin: the process for env {text!r} failed: {proc.stderr.strip()[-400:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append({"round": r + 1, "env": text, **got})
            print(f"round {r + 1}, env {text or '(inherited)'}: {json.dumps(got)}", flush=True)
    medians = {}
    for text, _ in sets:
        mine = [x for x in runs if x["env"] == text]
        med = {f"prefill_{n}_tok_s": statistics.median(x["prefill_tok_s"][str(n)] for x in mine) for n in args.prompt}
        if args.layer_tokens:
            for k in ("call_ns", "last_arrival_ns"):
                med[f"layer_{k.removesuffix('_ns')}_us"] = statistics.median(x["layer_call_us"][k] for x in mine)
        medians[text] = med
        print(f"env {text or '(inherited)'}: medians {json.dumps(med)}")
    write_record(args.out, "omp_spin.json", "cpu/omp_spin", "bench/cpu/omp_spin.py", None, threads=args.threads,
                 model=args.model, runs=runs, medians=medians)


if __name__ == "__main__":
    main()

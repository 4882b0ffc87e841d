"""Where a CPU decode step's time goes outside the compiled kernels, and what the weight streams do to it.

    python bench/cpu/host_overhead.py --model STORE [--tokens 128] [--stream-mib 80] [--calls 300] [--out DIR]

Loads `Engine.from_pretrained(STORE, device="cpu")` (the defaults; every expert in RAM before timing), then:

1. **The step's split.** A greedy generation of `--tokens` tokens after a 64-token prompt, each one-token forward
   pass timed whole (`MoETransformer.run_layers` and `logits`) and inside it the compiled calls (the dense kernel,
   `strata.kernels.cpu.dense.linear`, and the expert kernel, `strata.kernels.cpu.experts.run_packed` or, once every
   expert is pinned, the whole layer's call `strata.kernels.cpu.expert_rows.PinnedLayer.forward`), so that
   "host" = the pass less its compiled calls: the Python, torch's small ops and the compiled rows (norms, rotary,
   attention) between them. Per step, medians over the generation.
2. **The host work with caches warm and after a weight stream.** Three pieces of one decode layer's host work, each
   called `--calls` times: back to back (everything they touch stays in the caches), and with `--stream-mib` MiB
   (about one layer's weights) read between calls, as the kernels read weights between them in a decode step:
   the CPU expert share's own work (`CpuCompute.cpu_forward` on 8 resident experts of one token, its kernel call
   replaced by a no-op), `group_by_expert` and `softmax_topk` (the router's top-k). Medians, microseconds.

Results: DIR/host_overhead.json (and the summary on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _timed(owner, name: str, sink: list[float], gate: list[bool]):
    """Wrap owner.name so that each call's wall time is appended to `sink` while gate[0] is true; returns the
    original, to put back."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if not gate[0]:
            return original(*args, **kwargs)
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(owner, name, wrapper)
    return original


def step_split(engine, tokens: int) -> dict:
    """Per one-token step: the forward pass, its compiled calls and the rest, medians in ms."""
    from strata.kernels.cpu import dense
    from strata.kernels.cpu import experts as cpu_experts
    from strata.kernels.cpu.expert_rows import PinnedLayer
    from strata.runtime.model import transformer

    kernels: list[float] = []
    gate = [False]
    originals = [(dense, "linear", _timed(dense, "linear", kernels, gate)),
                 (cpu_experts, "run_packed", _timed(cpu_experts, "run_packed", kernels, gate)),
                 (PinnedLayer, "forward", _timed(PinnedLayer, "forward", kernels, gate))]
    steps: list[tuple[float, float]] = []  # (pass s, compiled calls s)
    run_layers, logits = transformer.MoETransformer.run_layers, transformer.MoETransformer.logits

    def timed_pass(fn):
        def wrapper(self, x, *args, **kwargs):
            gate[0] = x.shape[0] == 1  # a one-token decode pass (the prompt's passes are not counted)
            start, t = len(kernels), time.perf_counter()
            try:
                return fn(self, x, *args, **kwargs)
            finally:
                if gate[0]:
                    steps.append((time.perf_counter() - t, sum(kernels[start:])))
                gate[0] = False
        return wrapper

    transformer.MoETransformer.run_layers = timed_pass(run_layers)
    transformer.MoETransformer.logits = timed_pass(logits)
    try:
        prompt = [(7 * i + 3) % 4000 + 3 for i in range(64)]
        engine.generate(prompt, max_tokens=tokens, temperature=0.0, stop_token_ids=[])
    finally:
        transformer.MoETransformer.run_layers, transformer.MoETransformer.logits = run_layers, logits
        for owner, name, original in originals:
            setattr(owner, name, original)
    # one step = its run_layers entry then its logits entry
    per_step = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(steps[0::2], steps[1::2], strict=False)]
    total = statistics.median(s for s, _ in per_step) * 1e3
    compiled = statistics.median(k for _, k in per_step) * 1e3
    host = statistics.median(s - k for s, k in per_step) * 1e3
    return {"steps": len(per_step), "pass_ms": round(total, 3), "compiled_ms": round(compiled, 3),
            "host_ms": round(host, 3), "host_share": round(host / total, 3)}


def warm_and_streamed(engine, calls: int, stream_mib: int) -> dict:
    """Microseconds of three host pieces of a decode layer, back to back and with a weight-sized stream between."""
    import torch

    from strata.kernels.cpu import experts as cpu_experts
    from strata.kernels.experts import group_by_expert
    from strata.kernels.routing import softmax_topk

    compute = engine.executor
    if compute is None:
        raise SystemExit("host_overhead: this engine's experts are not tiered (runtime.experts = \"memory\"): no CPU "
                         "expert share to time; load the model with its default tiers")
    cfg = engine.checkpoint.config
    hidden, num_experts, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    layer = next(i for i, moe in enumerate(cfg.moe_layers) if moe)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(num_experts, generator=gen)[:k].reshape(1, k)
    weights = torch.rand(1, k, generator=gen)
    logits = torch.randn(1, num_experts, generator=gen).to(torch.bfloat16)
    groups = group_by_expert(ids, num_experts)
    stream = torch.ones(stream_mib << 19, dtype=torch.int16)  # stream_mib MiB
    pieces = {"cpu_share_host": lambda: compute.cpu_forward(layer, x, weights, k, groups),
              "group_by_expert": lambda: group_by_expert(ids, num_experts),
              "softmax_topk": lambda: softmax_topk(logits, k, cfg.norm_topk_prob)}
    kernel, cpu_experts.run_packed = cpu_experts.run_packed, lambda *a, **kw: True  # the host work alone
    out: dict = {}
    try:
        for label, between in (("warm", None), ("after_stream", lambda: stream.view(torch.int64).sum())):
            times = {name: [] for name in pieces}
            for _ in range(calls):
                for name, fn in pieces.items():
                    if between is not None:
                        between()
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            out[label] = {name: round(statistics.median(v) * 1e6, 1) for name, v in times.items()}
    finally:
        cpu_experts.run_packed = kernel
    out["after_over_warm"] = {n: round(out["after_stream"][n] / out["warm"][n], 2) for n in pieces}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint or store directory")
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens for the step split (default 128)")
    p.add_argument("--stream-mib", type=int, default=80, help="MiB read between calls (default 80: a bench layer)")
    p.add_argument("--calls", type=int, default=300, help="calls of each host piece per condition (default 300)")
    p.add_argument("--out", default=None, help="directory for host_overhead.json")
    args = p.parse_args(argv)

    import torch

    from strata import Engine

    engine = Engine.from_pretrained(args.model, device="cpu")
    engine.wait_settled()
    engine.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0)  # warm-up: kernels built, experts placed
    try:
        fields = {"model": args.model, "torch": torch.__version__, "load_avg": os.getloadavg()[0],
                  "step": step_split(engine, args.tokens),
                  "host_pieces_us": warm_and_streamed(engine, args.calls, args.stream_mib),
                  "stream_mib": args.stream_mib}
    finally:
        engine.close()
    from bench import provenance

    result = provenance.write_record(args.out, "host_overhead.json", "host_overhead", "bench/cpu/host_overhead.py",
                                     argv, **fields)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

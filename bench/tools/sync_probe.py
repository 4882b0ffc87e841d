"""Where a decode step still makes the host wait for the device: torch's sync debug mode over steady-state
decode steps, each synchronizing call reported once with the strata frames that made it.

    python bench/tools/sync_probe.py --model DIR [--config JSON] [--tokens 16] [--out DIR]

Overlapped decode ([debug] overlap_decode) gains only while nothing in a step reads a device value back
(a hidden `.item()`, a pageable copy, `torch.multinomial`'s check): each such call makes the host wait for
the step in flight. Writes sync_probe.json: {call site: count}.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from strata import Engine
    from strata.runtime.generation.requests import GenRequest
    from strata.runtime.generation.sampler import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="{}", help="strata config as JSON")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--label", default="case")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--device", default="cuda", help="cuda (the probe) or cpu (a smoke run: nothing to report)")
    args = ap.parse_args()
    engine = Engine.from_pretrained(args.model, config=json.loads(args.config), device=args.device)
    cuda = engine.device.type == "cuda"
    engine.wait_settled(300)
    vocab = engine.checkpoint.config.vocab_size
    prompt = [(100 + i * 37) % vocab for i in range(128)]
    for seed in (1, 2):  # warm-up: graphs captured, the mailbox open
        engine.generate(prompt, max_tokens=8, temperature=1.0, seed=seed)
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=3, ignore_eos=True)
    # the probe is on for the whole request, which runs on the scheduler's thread; calls before the first token
    # arrives count as the prefill's (the step after it may start meanwhile: one step at most is misfiled)
    sites = {"prefill": collections.Counter(), "decode": collections.Counter()}
    phase = ["prefill"]

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/strata/" in f.filename or "/bench/" in f.filename]
        sites[phase[0]][" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:])) or "?"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            steps = engine.scheduler().submit(GenRequest(prompt, params), asynchronous=False).iter_events()
            next(steps)  # the prefill and the first token
            phase[0] = "decode"
            n = sum(1 for ev in steps if ev.token_id is not None)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    out = {"label": args.label, "overlap": engine.overlap_decode, "tokens": n + 1,
           "graph_modes": sorted({k[3] for k in engine.model.graphs.graphs}) if engine.model.graphs else [],
           "syncs": dict(sites["decode"].most_common()), "prefill_syncs": dict(sites["prefill"].most_common())}
    print(json.dumps(out))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"sync_probe-{args.label}.json").write_text(json.dumps(out, indent=1))
    engine.close()


if __name__ == "__main__":
    main()

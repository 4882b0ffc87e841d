"""The ops a decode step dispatches, by module: on the CPU, the count of torch's kernel launches a GPU step makes
where no fused kernel replaces them (each op here is one launch there; views, other metadata-only ops and
conversions to the dtype a tensor has are left out). The routed experts run here through the reference loop, on a
GPU through the pair kernels: their count is the CPU's, not a GPU step's. At one token a step these launches, not the weights' bytes, set the new architectures' GPU decode time
(docs/benchmarks.md), so this says which chains to fuse next and what a fused kernel removes.

    python bench/decode_ops.py [--arch deepseek_v4] [--size small] [--layers N] [--streams 1] [--prompt 64] [--out DIR]

Writes the `--size` demo model of `--arch` (no Engram layers) under ~/.cache/strata/bench unless there, loads it on the
CPU in fp32 with every expert in memory, prefills `--streams` random prompts, then counts the ops of one DecodeBatch
step (the step a CUDA graph captures, after one untimed step): in all, and per innermost module class (an op runs in
the deepest module whose forward is active). Under `TRITON_INTERPRET=1` the fused kernels run through Triton's
interpreter, and each of their launches counts as one op. Prints and writes --out/decode_ops.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # strata from this checkout, unless PYTHONPATH names another
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.provenance import commit  # noqa: E402

# ops that move no data on a GPU (views, shape and metadata), left out of the count
METADATA = {"view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select",
            "as_strided", "split", "split_with_sizes", "unbind", "detach", "alias", "permute", "reshape", "lift_fresh",
            "_to_copy_noop", "empty", "empty_like", "empty_strided", "unfold", "narrow", "chunk", "diagonal",
            "view_as_real", "view_as_complex", "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "is_same_size"}


class OpCounter(TorchDispatchMode):
    """Counts every data-moving aten op, attributed to the innermost module running (`stack`); and, under Triton's
    interpreter, each Triton kernel launch as one op (`triton`), the interpreter's own copies inside it not counted."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack, self.by_module, self.by_op = stack, Counter(), Counter()
        self.in_triton = False

    def count(self, name: str) -> None:
        self.by_module[self.stack[-1] if self.stack else "(model)"] += 1
        self.by_op[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        noop = bool(args) and out is args[0]  # e.g. .to() of a tensor already in that dtype: no kernel
        if name not in METADATA and not noop and not self.in_triton:
            self.count(name)
        return out

    def __enter__(self):
        try:  # Triton's interpreter (TRITON_INTERPRET=1): a kernel launch is one op, whatever it copies
            from triton.runtime.interpreter import GridExecutor
        except ImportError:
            return super().__enter__()
        launch, counter = GridExecutor.__call__, self

        def counted(executor, *args, **kwargs):
            counter.count("triton")
            counter.in_triton = True
            try:
                return launch(executor, *args, **kwargs)
            finally:
                counter.in_triton = False

        self._restore = lambda: setattr(GridExecutor, "__call__", launch)
        GridExecutor.__call__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        getattr(self, "_restore", lambda: None)()
        return super().__exit__(*exc)



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="deepseek_v4")
    p.add_argument("--size", default="small")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="bench-out")
    a = p.parse_args(argv)
    from strata.runtime.model.checkpoint import Checkpoint
    from strata.runtime.model.kv_cache import DecodeBatch, StepBatch, kv_bucket
    from strata.runtime.model.loader import load_model

    tag = f"{a.arch}-{a.size}" + (f"-L{a.layers}" if a.layers else "")
    model_dir = Path(a.model or Path.home() / ".cache" / "strata" / "bench" / f"ops-{tag}")
    if not (model_dir / "config.json").exists():
        cmd = [sys.executable, "-m", "strata", "demo-model", str(model_dir), "--arch", a.arch, "--size", a.size,
               "--no-engram"] + (["--layers", str(a.layers)] if a.layers else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    model = load_model(Checkpoint.open(model_dir), torch.float32, "cpu")
    stack: list[str] = []

    def enter(mod, _args) -> None:
        stack.append(type(mod).__name__)

    def leave(_mod, _args, _out) -> None:  # None: the module's output stays its own
        stack.pop()

    for m in model.modules():
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)
    cache = model.new_cache(a.streams, a.prompt + 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    slots, lengths = list(range(a.streams)), [a.prompt] * a.streams
    with torch.inference_mode():
        for s in slots:
            model.run_layers(torch.randint(0, vocab, (a.prompt,), generator=g), StepBatch([s], [0], [a.prompt]), cache)
        ids = torch.randint(0, vocab, (a.streams,), generator=g)
        counter = OpCounter(stack)
        for step in range(2):  # the first step untimed (lazy state), the second counted
            batch = DecodeBatch(torch.tensor(slots), torch.tensor(lengths), kv_bucket(max(lengths), cache.max_len))
            if step:
                with counter:
                    model.run_layers(ids, batch, cache)
            else:
                model.run_layers(ids, batch, cache)
            lengths = [n + 1 for n in lengths]
    total = sum(counter.by_module.values())
    layers = model.cfg.num_layers
    result = {"bench": "decode_ops", "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python bench/decode_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "arch": a.arch, "size": a.size, "layers": layers, "streams": a.streams, "prompt": a.prompt,
              "ops_per_step": total, "ops_per_layer": round(total / layers, 1),
              "by_module": dict(counter.by_module.most_common()), "by_op": dict(counter.by_op.most_common(15))}
    print(f"{a.arch} {a.size} ({layers} layers, {a.streams} stream(s)): {total} ops a decode step, "
          f"{total / layers:.0f} a layer")
    for name, n in counter.by_module.most_common(12):
        print(f"  {name:32s} {n:6d}  ({n / total:.0%})")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "decode_ops.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

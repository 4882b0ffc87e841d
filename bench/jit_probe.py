"""Where a fresh install's first decode steps go: the kernel builds (Triton, CuPy) the serving warm-up triggers, each
timed, on empty kernel caches. Loads the engine in this process, wraps the compilers, runs `warm_up` through a
scheduler and prints the builds by kernel (count, seconds), the warm-up's seconds and what the builds took of them.

    TRITON_CACHE_DIR=$(mktemp -d) CUPY_CACHE_DIR=$(mktemp -d) python bench/jit_probe.py --model DIR \
        [--config JSON] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

_builds: list[tuple[str, str, float]] = []  # (compiler, kernel, seconds)


def _timed(compiler: str, fn, name_of):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _builds.append((compiler, name_of(args, kwargs), time.perf_counter() - t))
    return wrapper


def _triton_name(args: tuple, kwargs: dict) -> str:
    """The kernel a Triton build is of: its source's Python function (an ASTSource's `fn`), else the source's name."""
    src = next((a for a in (*args, kwargs.get("src")) if hasattr(a, "fn") or hasattr(a, "name")), None)
    fn = getattr(src, "fn", None)
    return getattr(fn, "__name__", None) or getattr(src, "name", None) or "?"


def wrap_compilers() -> list[str]:
    """Time every Triton and CuPy build from now on; returns what could be wrapped."""
    wrapped = []
    try:
        import triton.compiler.compiler as tc
        import triton.runtime.jit as tj

        timed = _timed("triton", tc.compile, _triton_name)
        tc.compile = timed
        if hasattr(tj, "compile"):  # JITFunction calls self.compile: the module's name, or a class attribute
            tj.compile = timed
        if "compile" in vars(tj.JITFunction):
            tj.JITFunction.compile = staticmethod(timed)
        wrapped.append("triton")
    except ImportError:
        pass
    try:
        import cupy.cuda.compiler as cc

        for attr in ("_compile_module_with_cache", "compile_with_cache"):
            if hasattr(cc, attr):
                setattr(cc, attr, _timed("cupy", getattr(cc, attr), lambda a, k: "cupy module"))
                wrapped.append(f"cupy.{attr}")
                break
    except ImportError:
        pass
    return wrapped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", default="{}", help="strata config as JSON")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    wrapped = wrap_compilers()
    from strata import Engine
    from strata.runtime.generation.warmup import warm_up

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(a.model, config=json.loads(a.config))
    load_s = time.perf_counter() - t0
    at_load = len(_builds)
    sched = engine.scheduler(max_batch=a.max_batch)
    try:
        report = warm_up(sched)
    finally:
        sched.stop()
        engine.close()
    by = collections.defaultdict(lambda: [0, 0.0])
    for compiler, name, s in _builds[at_load:]:
        by[(compiler, name)][0] += 1
        by[(compiler, name)][1] += s
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])
    built = sum(s for _, _, s in _builds[at_load:])
    out = {"wrapped": wrapped, "load_s": round(load_s, 2), "builds_at_load_s": round(sum(s for *_, s in _builds[:at_load]), 2),
           "warmup": report.describe(), "warmup_s": round(report.seconds, 2), "builds_in_warmup_s": round(built, 2),
           "builds": [{"compiler": c, "kernel": n, "count": k, "seconds": round(s, 3)} for (c, n), (k, s) in rows]}
    print(f"load {out['load_s']} s (builds {out['builds_at_load_s']} s); {report.describe()}; builds inside it: "
          f"{built:.2f} s over {len(_builds) - at_load} builds ({', '.join(wrapped) or 'no compiler wrapped'})")
    for r in out["builds"][:25]:
        print(f"  {r['compiler']:6s} {r['kernel'][:48]:48s} x{r['count']:<3d} {r['seconds']:7.3f} s")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "jit_probe.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""strata against llama.cpp on a CPU-only host, on identical weights (bf16, or Q4_K_M experts with --experts q4_k_m).

    python bench/cpu/cpu_vs_llamacpp.py [--layers 2 8] [--routing uniform skewed] [--rounds 3] [--threads 2] --out DIR
    python bench/cpu/cpu_vs_llamacpp.py --experts q4_k_m ...   # both engines on one GGUF, routed experts in Q4_K_M

For each bench model cut (`strata demo-model --size bench --layers N --no-engram`: Qwen3-30B-A3B's shape, bf16
random weights, `--route-skew uniform` or `--route-skew 1`), the checkpoint is written once as safetensors (and
packed into strata's store) and once as a bf16 GGUF with the same weights (strata.tiers.store.gguf_export, what
llama.cpp's convert_hf_to_gguf.py writes for qwen3moe). With `--experts TYPE` (q4_k_m, q8_0, ...; see
strata.tiers.store.gguf_mix) the GGUF's routed experts are quantized to TYPE (the dense tensors stay bf16) and
strata runs that very file too: its store is converted from the GGUF (`strata convert model.gguf STORE`), the
experts kept in their ggml blocks. Then:

1. the check: llama.cpp's log-probabilities at every position of a 32-token prompt against strata's float32
   reference (`runtime.dtype = "float32"`, experts by the reference math; with --experts, on the GGUF's experts
   dequantized) on the same prompt; a model whose difference exceeds bf16's tolerance is not timed (the GGUF would
   be wrong). It runs first on a plain random
   2-layer cut (no routing profile: its layers' activations are not small, so a wrong tensor shows), then on each
   timed cut;
2. `--rounds` rounds, each running llama.cpp and strata in processes of their own, alternating which goes first,
   with the same thread count (`--threads`: llama.cpp's n_threads and n_threads_batch; strata's runtime.threads and
   [debug] cpu_threads): prefill tok/s of a 64- and a 512-token prompt (submission to first token), and decode
   tok/s of 1 and 4 streams (64-token prompts, `--tokens` tokens each; greedy, as `Engine.generate` by default,
   so the figures are the engines' forward passes; `--temperature 1` samples with each engine's own sampler over the
   whole vocabulary instead, llama.cpp's `dist`, strata's, with fixed seeds). llama.cpp's 4
   streams are 4 sequences of one context decoded as one batch a step (its own batching, low-level API); strata's
   are 4 requests on its scheduler (one forward pass a step, `planner.max_batch` 4). bench/cpu/llamacpp_side.py and
   bench/cpu/strata_cpu_side.py are the two sides.

llama.cpp is llama-cpp-python 0.3.36 built from its sdist on this machine (`pip wheel`; a few minutes on 2 cores)
the first time, cached under the cache directory (--cache; default $STRATA_CACHE/bench, else
~/.cache/strata/bench) with the models. Every figure is recorded per round with the load average before it;
the summary takes medians and strata/llama.cpp ratios. Results: DIR/cpu_vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.suite.results import cpu_model  # noqa: E402
from strata.tiers.store.gguf_mix import EXPORT_TYPES as GGUF_EXPORT_TYPES  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
CHECK_TOKENS = 32
WARMUP_TOKENS = 256  # a warm-up prompt routes to nearly every expert of a uniform layer (each untouched: ~1e-7)
# the check: llama.cpp computes with bf16 activations (its bf16 dot products) and an f16 KV cache, the reference
# in float32; both see the same bf16 weights. Bounds on the log-probability differences (in nats) over the
# prompt's positions, and on how often the two agree on the most likely token. On the plain random cut a correct
# GGUF measured a median 0.004, p99 0.05 and full agreement, one with layer 1's gate and up experts swapped a
# median 0.05, p99 0.22 and 0.75 (on the routing-profile cuts the same swap is invisible: their layers run
# near-linear, where silu(g) u ~ g u / 2 is symmetric; hence the plain cut's check before any timing).
CHECK_MAX_MEDIAN = 0.02
CHECK_MAX_P99 = 0.12
PAGED_FAULTS = 256  # major page faults (1 MiB at 4 KiB pages) in a side's timed workloads: it read from disk
CHECK_MIN_TOP1 = 0.9


def cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser()
    base = os.environ.get("STRATA_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "strata") / "bench"


def say(msg: str) -> None:
    print(f"[cpu_vs_llamacpp] {msg}", file=sys.stderr, flush=True)


def ensure_llamacpp(cache: Path) -> Path:
    """The private install of llama-cpp-python (its site directory), built from the sdist when the cache lacks it."""
    root = cache / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    site, wheels = root / "site", root / "wheel"
    if (site / "llama_cpp" / "__init__.py").is_file():
        return site
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llama_cpp_python-*.whl")):
        say(f"building llama.cpp: pip wheel llama-cpp-python=={LLAMA_CPP_PYTHON} from its sdist "
            "(compiles llama.cpp for this CPU; a few minutes on 2 cores)")
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-w", str(wheels)], check=True)
        say(f"built in {time.time() - t0:.0f} s")
    wheel = sorted(wheels.glob("llama_cpp_python-*.whl"))[-1]
    say(f"installing {wheel.name} into {site}")
    tmp = root / "site.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # numpy and jinja2 come from this environment; diskcache is the one dependency it may lack
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp), str(wheel), "diskcache"],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    return site


def ensure_models(cache: Path, layers: int, routing: str, skew: float, keep_checkpoint: bool,
                  experts: str = "bf16") -> tuple[Path, Path]:
    """(strata store, GGUF) of one bench cut, each written once from one checkpoint; the checkpoint itself is
    removed once both exist unless `keep_checkpoint` (the three together take three times the weights' bytes).
    `routing`: "uniform", "skewed" (`--route-skew skew`) or "plain" (random weights as they are: no routing
    profile, so the layers' activations are not small; the writer's check runs on it). `experts` other than bf16:
    the GGUF's routed experts in that type, and the store converted from the GGUF."""
    from bench.suite.models import demo_model_path, ensure_model
    from strata.config import load_config
    from strata.runtime.plan.checkpoints.store_cache import ensure_store, gguf_store
    from strata.tiers.store.gguf_export import write_gguf

    models = cache / "models"
    ckpt_dir = demo_model_path(models, "bench", layers, routing, skew) if routing != "plain" else \
        models / f"bench-L{layers}-plain"
    tag = "" if experts == "bf16" else f"-{experts}"
    record = ckpt_dir.with_name(f"{ckpt_dir.name}{tag}.json")  # where the store and the GGUF are
    if record.is_file():
        paths = json.loads(record.read_text())
        store, gguf = Path(paths["store"]), Path(paths["gguf"])
        if store.is_dir() and gguf.is_file():
            return store, gguf
    written = (ckpt_dir / "strata_demo.json").is_file()  # a checkpoint kept (or left) from an earlier run
    checkpoint_bytes, gguf_bytes = model_bytes(layers, experts)
    need = (0 if written else checkpoint_bytes) + 2 * gguf_bytes  # the GGUF, and a store about as large
    models.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(models).free
    if free < need:
        raise SystemExit(f"the {layers}-layer bench model needs about {need / 1e9:.0f} GB free under {models} (checkpoint, "
                         f"store, GGUF) and {free / 1e9:.0f} GB are; use --clean, fewer --layers or another --cache")
    say(f"bench model, {layers} layers, {routing} routing: checkpoint")
    if routing == "plain":
        from strata.runtime.demo.model import write_demo_model

        ckpt = write_demo_model(ckpt_dir, "bench", layers, progress=True, engram=False)
    else:
        ckpt = ensure_model(models, "bench", layers, routing, skew, progress=True)
    gguf = ckpt.with_name(f"{ckpt.name}{tag}.gguf")
    if not gguf.is_file():
        say(f"writing {gguf.name} ({experts} GGUF, the same weights)")
        step = [0]

        def progress(name: str, done: int, total: int) -> None:
            if done - step[0] >= 1 << 30 or done == total:
                step[0] = done
                say(f"  {done / 2**30:.1f} / {total / 2**30:.1f} GiB ({name})")

        write_gguf(ckpt, gguf, progress, experts=experts)
    say("strata store" + (f" (from {gguf.name})" if experts != "bf16" else ""))
    cfg = load_config({"tiers": {"disk": {"path": str(cache)}}})
    store = ensure_store(ckpt, cfg, progress=True) if experts == "bf16" else gguf_store(gguf, cfg, progress=True)
    record.write_text(json.dumps({"store": str(store), "gguf": str(gguf), "checkpoint": str(ckpt)}))
    if not keep_checkpoint:
        shutil.rmtree(ckpt, ignore_errors=True)
    return store, gguf


def model_bytes(layers: int, experts: str) -> tuple[int, int]:
    """(the checkpoint's bytes, a bound on its GGUF's) of a bench cut: the routed experts at the most bytes a value
    of any type the export gives them, everything else as in the checkpoint (norms in f32: a few KiB more)."""
    from strata.runtime.demo.configs import demo_config
    from strata.runtime.demo.weights import tensor_specs
    from strata.tiers.store.gguf_mix import expert_type
    from strata.tiers.store.gguf_quantize import block_shape

    specs = tensor_specs(demo_config("bench", layers, engram=False))
    total = sum(s.nbytes for s in specs)
    expert = sum(s.nbytes for s in specs if ".mlp.experts." in s.name)
    kinds = {expert_type(experts, proj, layer, layers) for proj in ("ffn_gate_exps", "ffn_down_exps")
             for layer in range(layers)}
    per_bf16 = max(1.0 if k == "BF16" else block_shape(k)[1] / (2 * block_shape(k)[0]) for k in kinds)
    return total, total - expert + int(expert * per_bf16) + (1 << 20)


def remove_models(store: Path, gguf: Path) -> None:
    record = gguf.with_suffix(".json")
    checkpoint = json.loads(record.read_text()).get("checkpoint") if record.is_file() else None
    for p in (store, Path(checkpoint) if checkpoint else gguf.with_suffix("")):
        shutil.rmtree(p, ignore_errors=True)
    gguf.unlink(missing_ok=True)
    record.unlink(missing_ok=True)


def make_plan(args, seed: int, vocab: int) -> dict:
    """What both sides measure: fresh random prompts (ordinary tokens of the demo tokenizer) every round."""
    r = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [r.randrange(300, min(vocab, 8000)) for _ in range(n)]

    per_seq = max(args.prefill) + 16 if args.prefill else 0
    per_seq = max(per_seq, args.prompt + args.tokens + 16, WARMUP_TOKENS + 16)  # the warm-up is one sequence too
    return {"n_ctx_per_seq": per_seq, "n_ctx": per_seq * max(args.streams), "n_seq": max(args.streams),
            "n_batch": 512, "temperature": args.temperature, "warmup": prompt(WARMUP_TOKENS),
            "logits": {"ids": prompt(CHECK_TOKENS)},
            "prefill": [prompt(n) for n in args.prefill],
            "decode": [{"prompts": [prompt(args.prompt) for _ in range(s)], "tokens": args.tokens}
                       for s in args.streams]}


def run_side(cmd: list[str], env: dict, timeout: float) -> dict:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def side_commands(args, site: Path, store: Path, gguf: Path, plan_path: Path) -> dict[str, tuple[list[str], dict]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    llama_env = {**env, "PYTHONPATH": str(site)}
    strata_env = {**env, "PYTHONPATH": str(ROOT)}
    return {
        "llama.cpp": ([sys.executable, str(ROOT / "bench" / "cpu" / "llamacpp_side.py"), "--gguf", str(gguf),
                       "--threads", str(args.threads), "--plan", str(plan_path)], llama_env),
        "strata": ([sys.executable, str(ROOT / "bench" / "cpu" / "strata_cpu_side.py"), "--model", str(store),
                    "--threads", str(args.threads), "--plan", str(plan_path), "--dtype", args.strata_dtype],
                   strata_env),
    }


def check_logits(args, site: Path, store: Path, gguf: Path, work: Path) -> dict:
    """llama.cpp's log-probabilities against strata's float32 reference on one prompt; raises when they differ."""
    import numpy as np

    plan = make_plan(args, seed=1, vocab=8192)
    plan["prefill"], plan["decode"], plan["warmup"] = [], [], None
    plan["logits"]["out"] = str(work / "llama_logprobs.npy")
    plan_path = work / "check_plan.json"
    plan_path.write_text(json.dumps(plan))
    cmds = side_commands(args, site, store, gguf, plan_path)
    say("check: llama.cpp's log-probabilities")
    run_side(cmds["llama.cpp"][0], cmds["llama.cpp"][1], args.timeout)
    say("check: strata's float32 reference")
    ref_path = work / "reference_logprobs.npy"
    cmd, env = cmds["strata"]
    subprocess.run(cmd + ["--reference", str(ref_path)], env=env, check=True, capture_output=True, text=True,
                   timeout=args.timeout)
    ours, ref = np.load(plan["logits"]["out"]), np.load(ref_path)
    diff = np.abs(ours - ref)
    weight = np.exp(ref)  # where the reference puts its probability mass
    out = {"positions": int(ref.shape[0]), "vocab": int(ref.shape[1]),
           "median_abs_nats": float(np.median(diff)), "p99_abs_nats": float(np.quantile(diff, 0.99)),
           "max_abs_nats": float(diff.max()),
           "expected_abs_nats": float((weight * diff).sum(axis=1).mean()),
           "top1_agree": float((ours.argmax(1) == ref.argmax(1)).mean()),
           "reference_spread_nats": float(ref.std(axis=1).mean())}
    out["ok"] = (out["median_abs_nats"] <= CHECK_MAX_MEDIAN and out["p99_abs_nats"] <= CHECK_MAX_P99
                 and out["top1_agree"] >= CHECK_MIN_TOP1)
    say(f"check: median |d logprob| {out['median_abs_nats']:.4f}, p99 {out['p99_abs_nats']:.4f}, "
        f"max {out['max_abs_nats']:.3f} nats; top-1 agreement {out['top1_agree']:.2f} -> "
        f"{'ok' if out['ok'] else 'MISMATCH'}")
    return out


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def measure(args, site: Path, store: Path, gguf: Path, work: Path) -> list[dict]:
    rounds = []
    for r in range(args.rounds):
        plan_path = work / f"plan{r}.json"
        plan = make_plan(args, seed=100 + r, vocab=8192)
        plan.pop("logits")  # the check's alone
        plan_path.write_text(json.dumps(plan))
        cmds = side_commands(args, site, store, gguf, plan_path)
        order = ["llama.cpp", "strata"] if r % 2 == 0 else ["strata", "llama.cpp"]
        for name in order:
            load = load_average()
            say(f"round {r + 1}/{args.rounds}: {name} (load average {load})")
            res = run_side(*cmds[name], args.timeout)
            res.update(round=r, load_before=load, load_after=load_average())
            rounds.append(res)
            say("  " + summary_line(res))
    return rounds


def summary_line(res: dict) -> str:
    pre = ", ".join(f"prefill {p['prompt']}: {p['tok_s']:.1f}" for p in res["prefill"])
    dec = ", ".join(f"decode x{d['streams']}: {d['decode_tok_s']:.2f}" for d in res["decode"])
    return f"{res['engine']}: {pre}; {dec} tok/s"


def medians(rounds: list[dict]) -> dict:
    """Median tok/s per engine and workload, and strata / llama.cpp. A round that read weights back from disk while
    timed (more than PAGED_FAULTS major page faults: the page cache gave way under the other engine's memory) is
    left out where that engine has a round that did not; `paged` lists the rounds left out."""
    paged = [(r["engine"], r["round"]) for r in rounds if r.get("major_faults", 0) > PAGED_FAULTS]
    clean = {r["engine"] for r in rounds if r.get("major_faults", 0) <= PAGED_FAULTS}
    rounds = [r for r in rounds if r.get("major_faults", 0) <= PAGED_FAULTS or r["engine"] not in clean]
    table: dict[str, dict[str, list[float]]] = {}
    for res in rounds:
        row = table.setdefault(res["engine"], {})
        for p in res["prefill"]:
            row.setdefault(f"prefill_{p['prompt']}", []).append(p["tok_s"])
        for d in res["decode"]:
            row.setdefault(f"decode_x{d['streams']}", []).append(d["decode_tok_s"])
    med = {eng: {k: round(statistics.median(v), 2) for k, v in row.items()} for eng, row in table.items()}
    if "strata" in med and "llama.cpp" in med:
        med["ratio"] = {k: round(med["strata"][k] / med["llama.cpp"][k], 3) for k in med["strata"]
                        if med["llama.cpp"].get(k)}
    med["paged"] = [f"{e} round {i + 1}" for e, i in paged if e in clean]
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8], help="bench model cuts (default: 2 8)")
    p.add_argument("--routing", nargs="+", default=["uniform", "skewed"], choices=["uniform", "skewed"])
    p.add_argument("--skew", type=float, default=1.0, help="--route-skew of the skewed models (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per model (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per stream (default 32)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the decode workloads (default 64)")
    p.add_argument("--prefill", type=int, nargs="*", default=[64, 512], help="prefill prompt lengths (default 64 512)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="decode stream counts (default 1 4)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy; 1: each engine's sampler)")
    p.add_argument("--strata-dtype", default="auto", help='strata\'s runtime.dtype (default "auto": the default)')
    p.add_argument("--experts", default="bf16", choices=GGUF_EXPORT_TYPES,
                   help="the routed experts' type in the GGUF both engines run (default bf16: strata runs its own store "
                        "of the safetensors checkpoint; q4_k_m etc.: strata converts the GGUF; see gguf_mix)")
    p.add_argument("--cache", default=None, help="models and the llama.cpp build (default $STRATA_CACHE/bench, "
                                                 "else ~/.cache/strata/bench)")
    p.add_argument("--clean", action="store_true", help="remove each model's files after its measurements")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each model's safetensors checkpoint once its store and GGUF exist")
    p.add_argument("--skip-check", action="store_true", help="time without the logits check (not for reports)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one side's process may take")
    p.add_argument("--out", default=None, help="directory for cpu_vs_llamacpp.json")
    args = p.parse_args(argv)

    cache = cache_dir(args.cache)
    site = ensure_llamacpp(cache)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result: dict = {"bench": "cpu_vs_llamacpp", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
                    "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                    "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()},
                    "llama_cpp_python": LLAMA_CPP_PYTHON, "threads": args.threads, "experts": args.experts,
                    "models": []}
    out_path = Path(args.out) / "cpu_vs_llamacpp.json" if args.out else None
    if not args.skip_check:  # the GGUF writer itself, where a wrong tensor shows (see CHECK_MAX_MEDIAN)
        store, gguf = ensure_models(cache, 2, "plain", args.skew, args.keep_checkpoints, args.experts)
        with tempfile.TemporaryDirectory(prefix="cpu_vs_llamacpp-") as tmp:
            result["writer_check"] = check_logits(args, site, store, gguf, Path(tmp))
        if not result["writer_check"]["ok"]:
            raise SystemExit("llama.cpp's logits on the plain 2-layer cut differ from strata's float32 reference: the "
                             f"{args.experts} GGUF export is wrong; nothing is timed")
    for layers in args.layers:
        for routing in args.routing:
            store, gguf = ensure_models(cache, layers, routing, args.skew, args.keep_checkpoints, args.experts)
            entry: dict = {"layers": layers, "routing": routing, "experts": args.experts, "store": str(store),
                           "gguf": str(gguf),
                           "gguf_bytes": gguf.stat().st_size}
            with tempfile.TemporaryDirectory(prefix="cpu_vs_llamacpp-") as tmp:
                work = Path(tmp)
                if not args.skip_check:
                    entry["check"] = check_logits(args, site, store, gguf, work)
                if args.skip_check or entry["check"]["ok"]:
                    entry["rounds"] = measure(args, site, store, gguf, work)
                    entry["median"] = medians(entry["rounds"])
                    say(f"{layers} layers, {routing}: {json.dumps(entry['median'])}")
            result["models"].append(entry)
            if out_path is not None:
                out_path.parent.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(result, indent=1))
            if args.clean:
                remove_models(store, gguf)
    print(json.dumps({f"{m['layers']}L-{m['routing']}": m.get("median") or m.get("check") for m in result["models"]},
                     indent=1))
    return 0 if all("median" in m for m in result["models"]) else 1




if __name__ == "__main__":
    sys.exit(main())

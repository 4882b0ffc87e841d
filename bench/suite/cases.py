"""What the suite measures: engine variants x GPU budgets x routing x workloads, named and selectable.

A case name reads `variant/budget/routing/workload`, e.g. `split/b25/skewed/p128x1`: strata's default
engine with 25% of the expert bytes as its GPU budget, on the skewed checkpoint, one stream with a
128-token prompt. Cases that share everything but the workload share one loaded engine.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

ROUTINGS = ("uniform", "skewed")

# variant -> config sections merged over the suite's base config (strata.config keys)
VARIANTS: dict[str, dict] = {
    "ceiling": {"runtime": {"experts": "memory"}},  # every expert in VRAM
    "split": {},  # strata as shipped: tiered, cost-model split between PCIe copies and CPU compute, LFU, prefetch
    "naive": {"policy": {"eviction": "lru", "budget_scope": "per_layer"}, "prefetch": {"lookahead": 0},
              "runtime": {"cpu_numerics": "gpu"}},  # mixtral-offloading: per-layer LRU, copy on demand
    "no-prefetch": {"prefetch": {"lookahead": 0}},
    "copy-only": {"runtime": {"cpu_numerics": "gpu"}},  # CPU compute off: cold experts always copied
    "cpu-only": {},  # copy off: GPU expert budget 0, every routed expert computed on the CPU (llama.cpp --cpu-moe)
    "static": {"policy": {"eviction": "static"}},  # the planner's hot set never moves
    "disk": {},  # part of the experts only on disk: pinned RAM budget below the expert bytes
    "hf": {},  # transformers + accelerate offload (device_map="auto", max_memory = the same GPU budget)
    "serve": {},  # `strata serve` start-up until /health answers
    "repro": {},  # strata as shipped, every request reproducible (`strata_reproducible`): cold experts go to the GPU
    "llamacpp": {},  # llama.cpp on the checkpoint's bf16 GGUF, --n-cpu-moe for the budget (bench/suite/llamacpp_case.py)
    "llamacpp-q4_k_m": {},  # the same with the routed experts in Q4_K_M
    # strata as shipped on the very Q4_K_M GGUF file `llamacpp-q4_k_m` reads (bench/suite/strata_gguf_case.py)
    "split-q4_k_m": {},
}
LLAMACPP_VARIANTS = ("llamacpp", "llamacpp-q4_k_m")
# strata variants that run the routing's checkpoint exported as the GGUF a llama.cpp variant reads: -> export type
STRATA_GGUF_VARIANTS = {"split-q4_k_m": "q4_k_m"}
# the strata variant each llama.cpp variant is compared with: the one that computes the same weights
STRATA_TWIN = {"llamacpp": "split", "llamacpp-q4_k_m": "split-q4_k_m"}
# which cold-expert paths the roofline credits, per variant
COLD_PATHS = {"split": ("pcie", "cpu"), "split-q4_k_m": ("pcie", "cpu"), "no-prefetch": ("pcie", "cpu"),
              "static": ("pcie", "cpu"), "disk": ("pcie", "cpu"), "naive": ("pcie",), "copy-only": ("pcie",),
              "cpu-only": ("cpu",), "repro": ("pcie",)}


@dataclass(frozen=True)
class Workload:
    """Concurrent streams, each with a `prompt`-token prompt generating `tokens` tokens."""

    prompt: int
    streams: int
    tokens: int

    @property
    def name(self) -> str:
        return f"p{self.prompt}x{self.streams}"


@dataclass(frozen=True)
class Case:
    """One measurement."""

    variant: str
    routing: str
    gpu_fraction: float | None  # GPU expert budget as a fraction of the expert bytes; None: all in VRAM
    workload: Workload
    ram_fraction: float | None = None  # pinned RAM budget as a fraction of the expert bytes (disk case)
    group: str = "grid"  # grid | baseline | ablation | target | serve
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # config overrides beyond the variant's

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; known: {', '.join(VARIANTS)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; use uniform or skewed")

    @property
    def budget_label(self) -> str:
        if self.gpu_fraction is None:
            return "all"
        label = f"b{round(100 * self.gpu_fraction)}"
        return label + (f"-ram{round(100 * self.ram_fraction)}" if self.ram_fraction is not None else "")

    @property
    def name(self) -> str:
        tail = "startup" if self.variant == "serve" else self.workload.name
        return f"{self.variant}/{self.budget_label}/{self.routing}/{tail}"

    @property
    def engine_key(self) -> tuple:
        """Cases with equal keys run on one loaded engine."""
        return (self.variant, self.routing, self.gpu_fraction, self.ram_fraction, repr(sorted(self.extra.items())))


def quick_suite(tokens: int = 64) -> list[Case]:
    """Fits one 10-minute GPU call on a 12-layer bench model: 25% budget, one stream (plus one 8K prefill)."""
    w = Workload(128, 1, tokens)
    out = [Case("ceiling", "uniform", None, w, group="baseline"), Case("split", "uniform", 0.25, w),
           Case("split", "uniform", 0.25, Workload(8192, 1, 16)), Case("split", "skewed", 0.25, w),
           Case("hf", "uniform", 0.25, Workload(128, 1, 8), group="baseline")]
    out += [Case("naive", r, 0.25, w, group="baseline") for r in ROUTINGS]
    out += [Case("split", "skewed", 0.40, w, group="target"), Case("static", "skewed", 0.40, w, group="target")]
    out += [Case(v, "skewed", 0.0 if v == "cpu-only" else 0.25, w, group="ablation")
            for v in ("no-prefetch", "copy-only", "cpu-only", "static")]
    out += [Case("serve", "uniform", 0.25, w, group="serve")]  # `strata serve` ready in <= 30 s
    return out


def full_suite(tokens: int = 128) -> list[Case]:
    """Every case; split it over several runs with --cases."""
    grid = [Workload(128, s, tokens) for s in (1, 4, 8)] + [Workload(8192, 1, tokens)]
    one = Workload(128, 1, tokens)
    out: list[Case] = []
    for r in ROUTINGS:
        out += [Case("ceiling", r, None, w, group="baseline") for w in grid]
        out += [Case("split", r, f, w) for f in (0.10, 0.25, 0.50) for w in grid]
        out += [Case("naive", r, 0.25, one, group="baseline"), Case("hf", r, 0.25, one, group="baseline")]
        out += [Case(v, r, 0.0 if v == "cpu-only" else 0.25, one, group="ablation")
                for v in ("no-prefetch", "copy-only", "cpu-only", "static")]
        out += [Case("disk", r, 0.25, one, ram_fraction=0.5, group="ablation")]
        out += [Case("split", r, 0.40, one, group="target"), Case("static", r, 0.40, one, group="target")]
        out += [Case("repro", r, 0.25, one, group="ablation")]  # the reproducible mode's penalty
        out += [Case("split-q4_k_m", r, 0.25, w) for w in grid]  # strata on llama.cpp's Q4_K_M file: its ratios
        out += [Case(v, r, 0.25, w, group="baseline") for v in LLAMACPP_VARIANTS for w in grid]  # llama.cpp
    out += [Case("serve", "uniform", 0.25, one, group="serve")]
    return out


def llamacpp_suite(tokens: int = 64) -> list[Case]:
    """strata against llama.cpp at the 25% budget, per routing: decode of 1, 4 and 8 streams (128-token prompts)
    and prefill of 512- and 8K-token prompts (then 16 tokens), and one stream all in VRAM (uniform routing). Per
    routing, in this order: strata's split engine on
    the bf16 checkpoint (`split`), strata on the Q4_K_M GGUF export llama.cpp reads (`split-q4_k_m`, its budget 25%
    of that file's routed-expert bytes), then llama.cpp on the bf16 and Q4_K_M exports (the runner moves llama.cpp's
    cases after every strata case, so its tools can build meanwhile)."""
    work = [Workload(128, s, tokens) for s in (1, 4, 8)] + [Workload(p, 1, 16) for p in (512, 8192)]
    out = [Case(v, r, 0.25, w, group="baseline" if v in LLAMACPP_VARIANTS else "grid")
           for r in ROUTINGS for v in ("split", *STRATA_GGUF_VARIANTS, *LLAMACPP_VARIANTS) for w in work]
    # all in VRAM, one stream (uniform: the routing moves no bytes there): strata's ceiling and its Q4_K_M file with
    # no budget against llama.cpp with every layer's experts on the GPU (--n-cpu-moe 0)
    one = Workload(128, 1, tokens)
    return out + [Case(v, "uniform", None, one, group="baseline" if v in LLAMACPP_VARIANTS else "grid")
                  for v in ("ceiling", *STRATA_GGUF_VARIANTS, *LLAMACPP_VARIANTS)]


def with_baselines(cases: list[Case], baselines: list[str]) -> list[Case]:
    """`cases` plus, for every strata split case, the same case run by each baseline variant in `baselines`
    (`--baselines llamacpp` adds `llamacpp` twins; `llamacpp-q4_k_m` the Q4_K_M ones, each with strata's own run on
    that GGUF, `split-q4_k_m`, so its ratio compares the same weights), without duplicates."""
    unknown = [b for b in baselines if b not in LLAMACPP_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown baseline {unknown[0]!r}; --baselines takes {', '.join(LLAMACPP_VARIANTS)}")
    out = list(cases)
    split = [c for c in cases if c.variant == "split"]
    for b in baselines:
        if STRATA_TWIN[b] != "split":
            out += [Case(STRATA_TWIN[b], c.routing, c.gpu_fraction, c.workload, group="grid") for c in split]
        out += [Case(b, c.routing, c.gpu_fraction, c.workload, group="baseline") for c in split]
    return list(dict.fromkeys(out))


SUITES = {"quick": quick_suite, "full": full_suite, "llamacpp": llamacpp_suite}


def select(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    """Cases whose name matches any shell-style pattern (`split/b25/*`, `*/skewed/*`); all when none."""
    if not patterns:
        return list(cases)
    chosen = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if not chosen:
        raise SystemExit(f"no case matches {' '.join(patterns)}; `python -m bench list` shows the names")
    return chosen


def group_by_engine(cases: list[Case]) -> list[list[Case]]:
    """Cases grouped by engine (first-seen order), so each engine is loaded once."""
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.engine_key, []).append(c)
    return list(groups.values())

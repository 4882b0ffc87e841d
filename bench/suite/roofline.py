"""The bound each case is judged against, and the rates it is built from.

Time for a run of decode steps is at least the largest of
- GPU time: the weights the GPU reads from HBM (dense weights once per step, each GPU-computed
  expert once per step) / HBM bandwidth;
- cold time: the bytes of experts not resident on the GPU / (the rates of the paths the variant may
  use: PCIe copies from pinned RAM, CPU compute from RAM; both at once for strata's split);
- disk time: the bytes of experts read from disk / disk bandwidth.
The roofline tok/s is the tokens of the run over that time; strata's fraction is measured / roofline.
This is "time per token >= max(GPU time, cold bytes / (PCIe + CPU rates))", per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

# the H200 machine's reference rates, bytes per second (pinned -> GPU copies of large objects, the compiled CPU
# expert kernel, an HBM device copy, O_DIRECT disk reads): what a run uses where it measures none (`--rates limits`,
# or no compiled CPU kernel); `Rates.source` records them under a label of their own, which the report prints as
# "reference"
LIMITS = {"pcie": 55e9, "cpu": 70e9, "hbm": 4.3e12, "disk": 1.2e9}


@dataclass
class Rates:
    """Bandwidths in bytes/s; `source` says which were measured in this run and which are the reference rates."""

    pcie: float = LIMITS["pcie"]
    cpu: float = LIMITS["cpu"]
    hbm: float = LIMITS["hbm"]
    disk: float = LIMITS["disk"]
    source: dict = field(default_factory=lambda: dict.fromkeys(LIMITS, "reference"))
    extra: dict = field(default_factory=dict)  # measured figures reported but not used (RAM read bandwidth)

    def __post_init__(self) -> None:
        for key in LIMITS:
            v = getattr(self, key)
            if not (isinstance(v, int | float) and v > 0 and math.isfinite(v)):
                raise ValueError(f"rate {key} = {v!r} must be a positive number of bytes/s")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelFacts:
    """What the roofline needs about a checkpoint."""

    expert_bytes: int  # one routed expert (gate + up + down)
    dense_bytes_per_step: int  # non-expert weights a forward step reads (embedding table excluded: one row per token)
    num_experts: int  # per MoE layer
    experts_per_token: int
    moe_layers: int

    def expected_experts_per_step(self, tokens_per_step: int) -> float:
        """Distinct experts a step touches if B tokens route uniformly: per layer E * (1 - (1 - k/E)^B)."""
        e, k = self.num_experts, self.experts_per_token
        return self.moe_layers * e * (1 - (1 - k / e) ** max(1, tokens_per_step))


def roofline(*, tokens: int, steps: int, gpu_experts: float, cold_experts: float, disk_experts: float,
             facts: ModelFacts, rates: Rates, paths: tuple[str, ...]) -> dict:
    """The bound for a run that produced `tokens` tokens in `steps` forward steps.

    `gpu_experts`: expert computations done on the GPU (each reads its weights from HBM once);
    `cold_experts`: lookups answered from host RAM (copied or computed on the CPU);
    `disk_experts`: lookups that had to come from disk; `paths`: the cold paths the variant may use.
    """
    if tokens <= 0 or steps <= 0:
        raise ValueError("a roofline needs at least one token and one step")
    gpu_s = (steps * facts.dense_bytes_per_step + gpu_experts * facts.expert_bytes) / rates.hbm
    cold_rate = sum(getattr(rates, p) for p in paths)
    cold_bytes = cold_experts * facts.expert_bytes
    if cold_bytes and not cold_rate:
        raise ValueError("cold experts were served but the variant has no cold path to credit")
    cold_s = cold_bytes / cold_rate if cold_bytes else 0.0
    disk_s = disk_experts * facts.expert_bytes / rates.disk
    parts = {"gpu": gpu_s, "cold": cold_s, "disk": disk_s}
    bound = max(parts, key=parts.get)
    total = parts[bound]
    return {
        "tok_s": tokens / total if total > 0 else None,
        "bound": bound,
        "ms_per_token": {k: round(1e3 * v / tokens, 4) for k, v in parts.items()},
        "cold_bytes_per_token": int(cold_bytes / tokens),
        "paths": list(paths),
    }


def fraction(measured_tok_s: float | None, bound: dict | None) -> float | None:
    """Measured / roofline (None when either is missing)."""
    if not measured_tok_s or not bound or not bound.get("tok_s"):
        return None
    return round(measured_tok_s / bound["tok_s"], 4)


def measure_rates(device: str, reps: int = 5) -> Rates:
    """PCIe (pinned host -> GPU, 256 MiB), HBM (device copy, 1 GiB; read + write bytes) and the CPU path (expert-sized
    buffers streamed from RAM by the CPU kernel's pool, `cpu_stream_rate`) measured now; the disk rate the reference
    one; host RAM read bandwidth (torch.sum) measured for reference."""
    import torch

    rates = Rates()
    cpu = cpu_stream_rate(gpu_worker=device.startswith("cuda"))
    if cpu:
        rates.cpu = cpu
        rates.source["cpu"] = "measured"
    if device.startswith("cuda") and torch.cuda.is_available():
        n = 256 << 20
        src = torch.empty(n, dtype=torch.uint8).pin_memory()
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        rates.pcie = n / _best(lambda: dst.copy_(src, non_blocking=True), reps, sync=True)
        a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        rates.hbm = 2 * a.numel() / _best(lambda: b.copy_(a), reps, sync=True)
        rates.source.update(pcie="measured", hbm="measured")
        del src, dst, a, b
        torch.cuda.empty_cache()
    x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    rates.extra["ram_read_GBps"] = round(x.numel() * 4 / _best(lambda: x.sum(), 3, sync=False) / 1e9, 1)
    return rates


def cpu_stream_rate(gpu_worker: bool, pool_bytes: int = 1 << 30, piece_bytes: int = 9 << 20,
                    reps: int = 3) -> float | None:
    """Bytes/s at which the CPU expert kernel's thread pool reads expert-sized buffers (`piece_bytes`, ~ a Qwen3-30B
    expert in bf16) cycled over `pool_bytes` of RAM: the cold path's memory limit on this host, best of `reps`. With
    `gpu_worker`, on the thread count the one-graph decode's CPU worker takes beside a GPU (cores less
    MAILBOX_SPARE_CORES); else on every core. None where the compiled kernel is missing.

    Hosts of the same GPU differ: two H100 machines read RAM at 80 and 198 GB/s (torch.sum), and strata's worker
    computed experts at 70 and 147 GB/s on them, so with a fixed rate a split case's fraction measured the host."""
    import torch

    from strata.kernels.cpu import library
    from strata.runtime.offload.expert_compute import MAILBOX_SPARE_CORES

    n = library.default_threads()
    threads = max(1, n - (MAILBOX_SPARE_CORES if n >= 2 * MAILBOX_SPARE_CORES else 1)) if gpu_worker else n
    pieces = [torch.ones(piece_bytes // 2, dtype=torch.bfloat16) for _ in range(max(1, pool_bytes // piece_bytes))]
    if library.read_sweep(pieces, threads) is None:  # (this first sweep faults the pages in and starts the pool)
        return None
    best = min(library.read_sweep(pieces, threads) for _ in range(reps))
    return sum(t.numel() * t.element_size() for t in pieces) / best


def _best(fn, reps: int, sync: bool) -> float:
    import torch

    fn()
    best = float("inf")
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best

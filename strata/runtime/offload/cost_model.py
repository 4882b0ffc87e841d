"""Where each cold expert of a step is computed: on CPU threads from host RAM, or copied to a GPU slot.

Both paths run at once, so the best split finishes them together. For an expert of `b` bytes (in its stored
format: `ExpertLayout.payload_bytes`, about half of bf16's in FP8, a quarter in MXFP4) and `params` weights, with
`t` tokens routed to it:
- CPU: memory-bound for a few tokens (b / cpu_rate, the rate the kernel reads the format's bytes at), compute-bound
  beyond (2 * params * t / cpu_flops);
- copy: b / pcie_rate, then a GPU GEMM that is negligible next to the copy.
Prefill-sized groups (many tokens per expert) always go to the GPU, where the CPU would be
compute-bound. In a decode step the thread that drives the GPU stages the copies first and then runs
the CPU share (`serial=True`), so each copy also delays the CPU path by the host time it takes to stage
(`copy_host_s`, measured): when staging costs about what the CPU needs for an expert, the CPU takes them. Rates start from the machine's measured limits and follow what the runtime observes
(an exponential moving average), so a busy PCIe link or a slow CPU kernel shifts the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The rate at which the pair kernels read the GPU's share of a one-graph split decode step from pinned RAM in
# place (`GpuShare`'s starting point; bench/probes/zero_copy.py measures it, unchanged while the CPU reads RAM).
IN_PLACE_RATE = 45e9


@dataclass
class Rates:
    """Effective rates in bytes (or FLOP) per second, updated from observations."""

    cpu_bytes_per_s: float = 20e9  # torch's CPU matmul level until the compiled kernel is measured
    # pinned -> GPU, until measured: the H200 copies 8 MiB objects at ~54 GB/s (docs/benchmarks.md, section
    # "Tiers: copy and read rates", recorded at 582f5bc)
    pcie_bytes_per_s: float = 50e9
    cpu_flops: float = 1.0e12  # bf16 FLOP/s of all CPU threads together
    copy_host_s: float = 50e-6  # host seconds per expert copy staged in a decode step (measured as it runs)
    stage_fixed_s: float = 0.0  # host seconds a layer's staging costs whatever the copies (map upload, events)
    smoothing: float = 0.2
    # decayed sums for the staging fit seconds = stage_fixed_s + copy_host_s * copies: [n, sum c, sum c^2,
    # sum t, sum c*t] (least squares with exponential forgetting)
    _fit: list = field(default=None, repr=False)

    def __post_init__(self) -> None:
        c = self.copy_host_s  # the starting value weighs as one observation of a one-copy layer
        self._fit = [1.0, 1.0, 1.0, c, c]

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.cpu_bytes_per_s += self.smoothing * (nbytes / seconds - self.cpu_bytes_per_s)

    def observe_stage(self, copies: int, seconds: float) -> None:
        """A decode layer staged `copies` expert copies in `seconds` of host time.

        Staging has a part per layer (the slot map's upload, events, the lock) and a part per copy. Charging
        the whole to the copies made one copy look like ~150-300 us on the H200 box, more than the CPU needs
        for the expert, so the split never copied: fit both parts (decayed least squares), and until the
        layers seen differ in their copy counts, keep the fixed part at 0 and average per copy."""
        if copies <= 0 or seconds <= 0:
            return
        f, keep = self._fit, 1.0 - self.smoothing
        for i, v in enumerate((1.0, copies, copies * copies, seconds, copies * seconds)):
            f[i] = keep * f[i] + v
        n, sc, scc, st, sct = f
        det = n * scc - sc * sc
        if det > 1e-9 * n * scc:  # copy counts differ: both parts are identifiable
            per_copy = (n * sct - sc * st) / det
            fixed = (st - per_copy * sc) / n
            if per_copy > 0 and fixed >= 0:
                self.copy_host_s, self.stage_fixed_s = per_copy, fixed
                return
        self.copy_host_s, self.stage_fixed_s = st / sc, 0.0

    def observe_pcie(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.pcie_bytes_per_s += self.smoothing * (nbytes / seconds - self.pcie_bytes_per_s)


@dataclass
class Split:
    cpu: list[int]  # experts computed on the CPU
    copy: list[int]  # experts copied to GPU slots
    cpu_seconds: float
    copy_seconds: float


def cpu_seconds(nbytes: int, tokens: int, rates: Rates, params: int | None = None) -> float:
    """Time for the CPU to run one expert of `nbytes` (its format's bytes) and `params` weights over `tokens` tokens
    (params None: bf16 weights, bytes / 2)."""
    params = nbytes / 2 if params is None else params
    return max(nbytes / rates.cpu_bytes_per_s, 2 * params * tokens / rates.cpu_flops)


def split_cold(tokens: dict[int, int], nbytes: int, rates: Rates, *, in_flight_copy_s: float = 0.0,
               max_cpu_tokens: int = 32, allow_cpu: bool = True, serial: bool = False,
               params: int | None = None) -> Split:
    """Split cold experts (expert -> tokens routed to it) between CPU compute and copies: each expert `nbytes` in
    its stored format (what a copy moves and the CPU kernel reads) with `params` weights (None: bf16, nbytes / 2).

    Greedy on the makespan: experts go, most-tokens first, to whichever path would finish earlier;
    copies already in flight (e.g. prefetches) count against the copy path. `serial`: the CPU share
    starts only after the copies are staged, so each copy adds `rates.copy_host_s` to the CPU path;
    otherwise the CPU share runs while the copies are staged, and a copy costs the copy path the longer
    of its transfer and its staging.
    """
    stage = rates.copy_host_s if serial else 0.0
    fixed = rates.stage_fixed_s if serial else 0.0  # the layer's staging cost whatever the copies
    # not serial: the copies are staged while the CPU share runs, so a copy path cannot go faster than the
    # thread staging it (host seconds per copy) any more than the link carrying it
    c_copy = nbytes / rates.pcie_bytes_per_s if serial else max(nbytes / rates.pcie_bytes_per_s, rates.copy_host_s)
    order = sorted(tokens, key=lambda e: (-tokens[e], e))
    # greedy cannot see a fixed cost (no single copy is worth it, several may be): plan once with it paid
    # up front and once with no copy unless forced, and keep the shorter
    plans = [_greedy(order, tokens, nbytes, rates, in_flight_copy_s, c_copy, stage, fixed, max_cpu_tokens,
                     allow_cpu, copies=True, params=params)]
    if fixed > 0:
        plans.append(_greedy(order, tokens, nbytes, rates, in_flight_copy_s, c_copy, stage, fixed, max_cpu_tokens,
                             allow_cpu, copies=False, params=params))
    return min(plans, key=lambda p: (max(p.cpu_seconds, p.copy_seconds), len(p.copy)))


def _greedy(order, tokens, nbytes, rates, in_flight_copy_s, c_copy, stage, fixed, max_cpu_tokens, allow_cpu,
            copies: bool, params: int | None = None) -> Split:
    """One greedy pass; `copies`: the layer's fixed staging cost is paid up front and copies compete, else
    only experts the CPU may not take are copied (the fixed cost then comes with the first of them)."""
    copy_s, cpu_s = in_flight_copy_s, fixed if copies else 0.0
    cpu, copy = [], []
    for expert in order:
        t = tokens[expert]
        if not allow_cpu or t > max_cpu_tokens:
            if not copy and not copies:
                cpu_s += fixed
            copy.append(expert)
            copy_s, cpu_s = copy_s + c_copy, cpu_s + stage
            continue
        c_cpu = cpu_seconds(nbytes, t, rates, params)
        if not copies or max(cpu_s + c_cpu, copy_s) < max(cpu_s + stage, copy_s + c_copy):
            cpu.append(expert)
            cpu_s += c_cpu
        else:
            copy.append(expert)
            copy_s, cpu_s = copy_s + c_copy, cpu_s + stage
    if copies and not copy:
        cpu_s -= fixed  # nothing was staged after all
    return Split(sorted(cpu), sorted(copy), cpu_s, copy_s)

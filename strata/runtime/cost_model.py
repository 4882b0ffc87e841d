"""Where each cold expert of a step is computed: on CPU threads from host RAM, or copied to a GPU slot.

Both paths run at once, so the best split finishes them together. For an expert of `b` bytes with
`t` tokens routed to it:
- CPU: memory-bound for a few tokens (b / cpu_rate), compute-bound beyond (2 * params * t / cpu_flops);
- copy: b / pcie_rate, then a GPU GEMM that is negligible next to the copy.
Prefill-sized groups (many tokens per expert) always go to the GPU, where the CPU would be
compute-bound. In a decode step the thread that drives the GPU stages the copies first and then runs
the CPU share (`serial=True`), so each copy also delays the CPU path by the host time it takes to stage
(`copy_host_s`, measured): when staging costs about what the CPU needs for an expert, the CPU takes them. Rates start from the machine's measured limits and follow what the runtime observes
(an exponential moving average), so a busy PCIe link or a slow CPU kernel shifts the split.
"""

from __future__ import annotations

from dataclasses import dataclass

# The GPU's share of a split decode step read from pinned RAM in place by the pair kernels: their rate
# until measured (bench/zero_copy.py: 49-51 GB/s on the H200 box, unchanged while the CPU reads RAM), and
# the host time it adds per expert (one address in the step's upload; the launch is once per layer).
IN_PLACE_RATE = 45e9
IN_PLACE_HOST_S = 10e-6


@dataclass
class Rates:
    """Effective rates in bytes (or FLOP) per second, updated from observations."""

    cpu_bytes_per_s: float = 20e9  # torch's CPU matmul level until the compiled kernel is measured
    pcie_bytes_per_s: float = 50e9  # pinned -> GPU (LIMITS.md: 52.8 GB/s at 8 MiB)
    cpu_flops: float = 1.0e12  # bf16 FLOP/s of all CPU threads together
    copy_host_s: float = 50e-6  # host seconds to stage one expert copy in a decode step (measured as it runs)
    smoothing: float = 0.2

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.cpu_bytes_per_s += self.smoothing * (nbytes / seconds - self.cpu_bytes_per_s)

    def observe_stage(self, copies: int, seconds: float) -> None:
        """A decode layer staged `copies` expert copies in `seconds` of host time."""
        if copies > 0 and seconds > 0:
            self.copy_host_s += self.smoothing * (seconds / copies - self.copy_host_s)

    def observe_pcie(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.pcie_bytes_per_s += self.smoothing * (nbytes / seconds - self.pcie_bytes_per_s)


@dataclass
class Split:
    cpu: list[int]  # experts computed on the CPU
    copy: list[int]  # experts copied to GPU slots
    cpu_seconds: float
    copy_seconds: float


def cpu_seconds(nbytes: int, tokens: int, rates: Rates) -> float:
    """Time for the CPU to run one expert over `tokens` tokens (bf16 weights: params = bytes / 2)."""
    return max(nbytes / rates.cpu_bytes_per_s, 2 * (nbytes / 2) * tokens / rates.cpu_flops)


def split_cold(tokens: dict[int, int], nbytes: int, rates: Rates, *, in_flight_copy_s: float = 0.0,
               max_cpu_tokens: int = 32, allow_cpu: bool = True, serial: bool = False) -> Split:
    """Split cold experts (expert -> tokens routed to it) between CPU compute and copies.

    Greedy on the makespan: experts go, most-tokens first, to whichever path would finish earlier;
    copies already in flight (e.g. prefetches) count against the copy path. `serial`: the CPU share
    starts only after the copies are staged, so each copy adds `rates.copy_host_s` to the CPU path;
    otherwise the CPU share runs while the copies are staged, and a copy costs the copy path the longer
    of its transfer and its staging.
    """
    copy_s, cpu_s = in_flight_copy_s, 0.0
    stage = rates.copy_host_s if serial else 0.0
    # not serial: the copies are staged while the CPU share runs, so a copy path cannot go faster than the
    # thread staging it (host seconds per copy) any more than the link carrying it
    c_copy = nbytes / rates.pcie_bytes_per_s if serial else max(nbytes / rates.pcie_bytes_per_s, rates.copy_host_s)
    cpu, copy = [], []
    for expert in sorted(tokens, key=lambda e: (-tokens[e], e)):
        t = tokens[expert]
        if not allow_cpu or t > max_cpu_tokens:
            copy.append(expert)
            copy_s, cpu_s = copy_s + c_copy, cpu_s + stage
            continue
        c_cpu = cpu_seconds(nbytes, t, rates)
        if max(cpu_s + c_cpu, copy_s) < max(cpu_s + stage, copy_s + c_copy):
            cpu.append(expert)
            cpu_s += c_cpu
        else:
            copy.append(expert)
            copy_s, cpu_s = copy_s + c_copy, cpu_s + stage
    return Split(sorted(cpu), sorted(copy), cpu_s, copy_s)

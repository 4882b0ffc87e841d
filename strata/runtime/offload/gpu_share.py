"""The GPU's own share of a one-graph split decode layer's cold experts (strata.runtime.offload.mailbox): which
intermediate rows of which cold experts the GPU reads in place over PCIe while the CPU worker computes the rest,
and how that share follows how often the GPU waited for the worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from strata.kernels.gpu.experts.grouped import HostExperts


class GpuShare:
    """The GPU's own share of a mailbox layer's cold experts, read in place from pinned RAM over PCIe by the
    pair kernels (`pair_experts_in_place`) while the worker computes the rest: the two read host RAM at once
    (~50 + ~110 GB/s on the H200 box, bench/probes/ram_shared.py).

    The share is cut in intermediate rows, not whole experts: a layer's c cold experts (ascending) are c x G
    granules of `granule` rows each (`row_granule`), and the GPU takes the last q of them, the q that makes the
    layer end soonest, max(q / gpu rate, (cG - q) / CPU rate), ties to the CPU. One expert can so be split: the
    worker computes its first rows, the GPU the rest, and the two partial sums add up in the combine (down is
    linear in the intermediate rows). Whole experts would leave a lone cold expert, the common case under skewed
    routing, to one side.
    An expert is cut once for all its tokens (batched decode reads each expert once). `share` (a device scalar,
    read by the captured step) starts at the rates' ratio, gpu rate / (gpu rate + CPU rate), and unless fixed
    follows, by `MailboxBooks`' readings of the worker, how often the GPU had to wait for the worker's answer
    (`balance`). That sees what the rates miss: each side's fixed costs a layer, and the GPU's in-place rate beside
    the worker (~27 GB/s measured against the 45 assumed, `gpu_rate`), which let the rule before it (the worker's
    kernel rate against `gpu_rate`) run away to the cap on slow hosts. On CUDA, `strata.kernels.gpu.mailbox_pack`
    computes `assign` in its fused kernel; this torch version is its reference."""

    MAX = 0.6  # of the cold rows, at most (the GPU's in-place reads slow the CPU kernel's own)
    # A layer ends at max(worker, GPU). Moving a granule to the GPU saves the worker t_c and costs the GPU t_g, so the
    # expected end is least where P(GPU waited) t_c = P(worker waited) t_g: the GPU should wait in t_g / (t_c + t_g)
    # of the layers, ~0.7 with the worker's ~100 GB/s against the in-place reads' ~30-45
    WAIT_TARGET = 0.7
    GAIN = 0.1  # share moved per unit of (waited - target), once a window of layers

    def __init__(self, addresses: np.ndarray, experts, device: torch.device, share: float, adaptive: bool = True,
                 gpu_rate: float = 45e9, granule: int | None = None, wait_target: float | None = None):
        self.table = torch.from_numpy(np.ascontiguousarray(addresses)).to(device)  # [L, E] int64 host addresses
        self.experts, self.adaptive, self.num_experts = experts, adaptive, addresses.shape[1]
        self.wait_target = self.WAIT_TARGET if wait_target is None else wait_target
        if not 0.0 < self.wait_target < 1.0:
            raise ValueError(f"the GPU share's wait target must lie in (0, 1), got {self.wait_target}")
        self.gpu_rate = gpu_rate  # bytes/s the pair kernels read pinned RAM in place at, beside the CPU kernel
        self.inter = experts.down_shape[1]  # I: an expert's intermediate rows
        granule = granule or row_granule(self.inter, down_block(experts))
        self.rows = granule if self.inter % granule == 0 else self.inter  # rows a granule
        self.granules = self.inter // self.rows  # G granules an expert
        self.value = self.target = min(self.MAX, max(0.0, share))
        self.share = torch.tensor([self.value], dtype=torch.float32, device=device)  # [1], read by the step

    def assign(self, layer: int, flat: torch.Tensor, used: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """flat [P] experts, used [P] int32 (-1 cold) -> (used with -2 for the pairs the GPU computes whole,
        their addresses [P] int64 (0: no GPU part), rows [P] int32: of each cold pair, the leading intermediate
        rows the worker computes (the GPU computes the rest). Device ops only: no host sync."""
        g = self.granules
        cold_e = torch.zeros(self.num_experts, dtype=torch.int32, device=flat.device)
        cold_e.scatter_reduce_(0, flat, (used < 0).to(torch.int32), reduce="amax")  # [E] 1: cold and used
        avail = torch.full_like(cold_e, g)  # [E] granules of each expert
        mine = cold_e * avail  # [E] the split's granules of each cold expert
        total = mine.sum().float()  # the layer's cold granules
        low = torch.floor(total * self.share)  # [1] the GPU's granules rounded down: the CPU's side is longer...
        q = low + ((low + 1) * (1 - self.share) < (total - low) * self.share).float()  # ...up where that ends sooner
        before = (torch.cumsum(mine, 0) - mine).float()  # [E] cold granules of the experts before e
        cpu_rows = ((total - q - before).clamp(min=0).minimum(avail.float()) * self.rows).to(torch.int32)  # [E]
        end = (avail * self.rows).to(torch.int32)  # [E] where e's in-place rows stop
        gpu_e = (cpu_rows < end) & (cold_e > 0)  # [E] with an in-place part
        take, rows = gpu_e[flat], cpu_rows[flat]
        addr = torch.where(take, self.table[layer][flat], torch.zeros_like(flat))
        used = torch.where(take & (rows == 0), torch.full_like(used, -2), used)
        return used, addr, rows

    def balance(self, waited: float) -> None:
        """Of the last layers the worker computed some of, the fraction in which the GPU found no answer yet and
        waited: more than `wait_target`, the worker is the long pole too often and the GPU takes more; less, the
        GPU's own work ran past the answer and it takes less."""
        if self.adaptive:
            moved = self.target + self.GAIN * (min(1.0, max(0.0, waited)) - self.wait_target)
            self.target = min(self.MAX, max(0.0, moved))

    def apply(self) -> None:
        """Between steps, on the decoding thread: the device's share follows the target. Stream-ordered and
        without a host wait: with overlapped decode the previous step may still be reading the old value."""
        if self.target != self.value:
            self.value = self.target
            new = torch.tensor([self.value], dtype=torch.float32)
            if self.share.is_cuda:
                new = new.pin_memory()  # a pageable source would make the copy wait for the stream
            self.share.copy_(new, non_blocking=True)


def row_granule(inter: int, block: int = 1) -> int:
    """Rows of the granules a split expert is cut in: 64 where they divide I into 4 or more (whole cache lines
    of each down row on each side: 128 bytes of bf16), else the largest of 32, 16, 8 that does (small test
    models), else I (no split). `block`: the values of a block of down's rows (GGUF's 256 or 32), which a cut
    may not fall inside (the CPU kernel would read a cut block's values one by one): then the block where it
    divides I, else I."""
    granule = next((g for g in (64, 32, 16, 8) if inter % g == 0 and inter // g >= 4), inter)
    if granule % block:
        granule = block if inter % block == 0 else inter
    return granule


def down_block(experts: HostExperts) -> int:
    """The values of a block of down's rows that a cut must respect: the widest GGUF block of down's types; 1
    for the other formats (their kernels cut anywhere)."""
    layout = experts.layout
    if layout is None or layout.fmt.kind != "gguf":
        return 1
    from strata.kernels.gguf_blocks import BLOCK_TYPES

    return max(BLOCK_TYPES[t].block_values for t in layout.fmt.ggml[2])

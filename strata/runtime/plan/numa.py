"""NUMA binding: keep the CPU expert threads and pinned RAM on the GPU's socket.

On a two-socket host, CPU threads reading experts from the far socket's RAM lose a third of their
bandwidth (a peer engine went from 53 to 63 tok/s by binding). Containers often refuse the calls
silently, so binding degrades step by step and the binding actually in force is reported:

1. memory-preferred: `set_mempolicy(MPOL_PREFERRED, node)` plus CPU affinity to the node's cores;
2. CPU-only: affinity to the node's cores (memory left to the kernel's first-touch policy);
3. none: single-node hosts, hosts without NUMA information, or every call refused.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYS_NODE = Path("/sys/devices/system/node")
MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = 238  # x86-64


@dataclass
class Binding:
    """The binding in force."""

    mode: str  # "memory-preferred" | "cpu-only" | "none"
    node: int | None
    cpus: list[int]
    reason: str = ""

    def describe(self) -> str:
        if self.mode == "none":
            return f"NUMA: not bound ({self.reason})"
        return f"NUMA: {self.mode} binding to node {self.node} (CPUs {_ranges(self.cpus)})"


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: Path = SYS_NODE) -> dict[int, list[int]]:
    """node -> its CPUs, from sysfs ({} when the host exposes no NUMA information)."""
    nodes = {}
    for d in sorted(root.glob("node[0-9]*")):
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def gpu_numa_node(device_index: int = 0) -> int | None:
    """The NUMA node of a CUDA device's PCI slot (None when unknown)."""
    try:
        import torch

        props = torch.cuda.get_device_properties(device_index)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
        return node if node >= 0 else None
    except Exception:  # noqa: BLE001 - no CUDA, no sysfs entry, an old torch: unknown
        return None


def _set_mempolicy_preferred(node: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    if libc.syscall(_SYS_SET_MEMPOLICY, MPOL_PREFERRED, ctypes.byref(mask), ctypes.sizeof(mask) * 8 + 1) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def bind_to_node(node: int | None, nodes: dict[int, list[int]] | None = None,
                 set_mempolicy: Callable[[int], None] = _set_mempolicy_preferred,
                 set_affinity: Callable[[list[int]], None] = lambda cpus: os.sched_setaffinity(0, cpus)) -> Binding:
    """Bind this process to `node` as far as the host allows; never raises."""
    nodes = numa_nodes() if nodes is None else nodes
    if len(nodes) <= 1:
        return Binding("none", None, [], "single NUMA node" if nodes else "no NUMA information")
    if node is None or node not in nodes:
        return Binding("none", None, [], "the GPU's NUMA node is unknown")
    cpus = nodes[node]
    try:
        set_affinity(cpus)
    except OSError as e:
        return Binding("none", node, [], f"CPU affinity refused: {e.strerror or e}")
    try:
        set_mempolicy(node)
    except OSError as e:
        return Binding("cpu-only", node, cpus, f"memory policy refused: {e.strerror or e}")
    return Binding("memory-preferred", node, cpus)


def _ranges(cpus: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)

"""The tier manager's plain data: budgets, handles, errors, and small policy helpers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import StrataError
from strata.tiers.storage.gds import GpuDirectReader

Key = tuple[int, int]  # (layer, expert)
MIN_PINNED_SLOTS = 16  # staging for GPU copies even when the pinned budget is 0 (4 without a GPU tier)
FULL_WAIT_S = 30.0  # how long a lookup or placement waits for other threads to free slots of a full tier


def gpu_direct_reader(mode: str) -> GpuDirectReader | None:
    """The kvikio reader `tiers.disk.reader` asks for (None: the POSIX path)."""
    if mode == "posix":
        return None
    if mode == "kvikio":
        return GpuDirectReader()  # a clear error when kvikio is missing
    if not GpuDirectReader.available():
        return None
    try:
        reader = GpuDirectReader()
        compat = reader.compat_preferred()
    except Exception:  # noqa: BLE001 - "auto" never fails start-up over an optional reader
        return None
    if compat:
        reader.close()  # no GPUDirect Storage here: kvikio would only add a bounce buffer
        return None
    return reader


def static_hot_slots(capacity: int) -> int:
    """Slots the static policy gives its hot set; the rest (at least one) rotate for cold experts."""
    return capacity - max(1, capacity // 4)


class TierFullError(StrataError):
    """Every slot of a tier is in use: the budget is smaller than one step's working set."""


@dataclass
class TierBudgets:
    """Slots per tier (from the planner) and how they are shared."""

    gpu_slots: int = 0
    pinned_slots: int = 0
    tmpfs_bytes: int = 0
    per_layer: bool = False

    def __post_init__(self) -> None:
        if min(self.gpu_slots, self.pinned_slots, self.tmpfs_bytes) < 0:
            raise StrataError(f"tier budgets must be >= 0, got {self}")


@dataclass
class ExpertHandle:
    """A resident copy in use: typed views gate_up [2I, H], down [H, I] of its slot."""

    key: Key
    tier: str  # "gpu" | "pinned"
    slot: int
    gate_up: torch.Tensor
    down: torch.Tensor
    event: object = None  # torch.cuda.Event the compute stream must wait on (GPU copies)
    owner: int = 0  # thread that acquired it (the manager knows who holds what while it waits for slots)

    def wait(self) -> None:
        """Make the current CUDA stream wait for this copy (no host synchronisation)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

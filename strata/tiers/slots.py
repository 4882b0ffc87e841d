"""The tier manager's plain data: budgets, handles, errors, and small policy helpers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import StrataError
from strata.kernels.quant import QuantMatrix
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
    """A resident copy in use: its slot's gate_up [2I, H] and down [H, I] as stored (`matrices`: values and, for
    FP8 and MXFP4, scales; views of the slot). `gate_up` / `down` are the typed views of plain formats;
    `weights(dtype)` gives the weights of any format in a compute dtype."""

    key: Key
    tier: str  # "gpu" | "pinned"
    slot: int
    matrices: tuple[QuantMatrix, QuantMatrix]
    event: object = None  # torch.cuda.Event the compute stream must wait on (GPU copies)
    owner: int = 0  # thread that acquired it (the manager knows who holds what while it waits for slots)

    @property
    def quantized(self) -> bool:
        return self.matrices[0].kind != "plain"

    @property
    def gate_up(self) -> torch.Tensor:
        """gate_up [2I, H], a typed view of the slot (plain formats; `TypeError` for quantized ones)."""
        return self._plain(0)

    @property
    def down(self) -> torch.Tensor:
        """down [H, I], a typed view of the slot (plain formats; `TypeError` for quantized ones)."""
        return self._plain(1)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) in `dtype` on the slot's device: plain formats converted (the views
        themselves when already `dtype`), FP8 and MXFP4 dequantized into new tensors (the expert's scratch)."""
        gate_up, down = self.matrices
        return gate_up.dequantize(dtype), down.dequantize(dtype)

    def _plain(self, i: int) -> torch.Tensor:
        m = self.matrices[i]
        if m.kind != "plain":
            raise TypeError(f"expert {self.key} is stored in {m.kind}: it has no typed views; use weights(dtype) or "
                            "matrices")
        return m.values

    def wait(self) -> None:
        """Make the current CUDA stream wait for this copy (no host synchronisation)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

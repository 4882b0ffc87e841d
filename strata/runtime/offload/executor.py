"""`ExpertExecutor`: the tiered expert executor as the engine and the tools read it (`Engine.executor`).

One card's executor is an `ExpertCompute` (strata.runtime.offload.expert_compute); a model split over cards has a
`StagedCompute` (strata.runtime.plan.multi_device) over one `ExpertCompute` a card, which answers for the cards
as one: sums where each card counts its own, the first card's object where the cards share one (the CPU worker's
measured rates) or where only one card's state can be shown.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strata.runtime.offload.cost_model import Rates
    from strata.runtime.offload.gpu_share import GpuShare
    from strata.runtime.offload.mailbox import CpuMailbox
    from strata.runtime.offload.mailbox_books import MailboxBooks
    from strata.runtime.offload.warm_ahead import WarmAhead
    from strata.tiers.prefetch import LookaheadPrefetcher


class ExpertExecutor(Protocol):
    """What serves a model's routed experts from the tiers (see the module docstring for its two forms)."""

    reproducible: bool
    """Set around a forward pass of reproducible requests (`Engine.numerics`): cold experts then take the exact
    path (the GPU, or the CPU's reference math), never the forked CPU kernel."""

    @property
    def manager(self):
        """The tier manager its experts come from (`TierManager`; `DeviceTiers` over several cards)."""

    @property
    def rates(self) -> Rates:
        """The cost model's measured rates (CPU kernel, PCIe, staging)."""

    @property
    def cpu_experts(self) -> int:
        """Experts computed on the CPU so far."""

    @property
    def promotions(self) -> int:
        """Cold experts the split copied into the GPU tier because they became popular (`policy.promote`)."""

    @property
    def host_seconds(self) -> Counter[str]:
        """Host seconds of the decode cold path, by phase (waiting for the GPU, staging copies, the CPU share...)."""

    @property
    def cpu_async(self) -> bool | None:
        """Whether a decode layer's CPU share starts before its copies are staged (None: chosen per layer)."""

    @property
    def cpu_threads(self) -> int | None:
        """The CPU kernel's thread count (None: the kernel's default)."""

    @property
    def prefetcher(self) -> LookaheadPrefetcher | None:
        """The lookahead prefetcher (None with `prefetch.lookahead = 0`)."""

    @property
    def mailbox(self) -> CpuMailbox | None:
        """One-graph split decode's CPU worker, once every expert sits in pinned RAM for good (else None)."""

    @property
    def books(self) -> MailboxBooks | None:
        """The mailbox steps' statistics, policy history and promotions (with the mailbox)."""

    @property
    def gpu_share(self) -> GpuShare | None:
        """The cold experts the GPU reads in place during a mailbox step (with the mailbox, on a split)."""

    @property
    def warm_ahead(self) -> WarmAhead | None:
        """The worker's read of the next layer's predicted cold experts (`[debug] warm_ahead`, with a GPU share)."""

    def all_resident(self) -> bool:
        """True once every expert is in a GPU slot for good (decode steps then need no host round trip)."""

    def mailbox_stats(self) -> dict:
        """One-graph split decode's state: whether it runs (and why not), the worker's totals, the GPU share."""

    def close_mailbox(self) -> None:
        """Stop the mailbox worker and its books (the engine is closing; no step may be in flight)."""

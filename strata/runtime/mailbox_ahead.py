"""The mailbox worker's two read-ahead hooks, started once per worker (`CpuMailbox` inherits them): copy-ahead's
tail copies issued on the copy engine by a thread of the worker's own (csrc/mailbox_ahead.h), and warm-ahead's reads
of the next layer's predicted cold experts (csrc/cpu_mailbox.cpp, WarmCfg). `strata.runtime.copy_ahead` plans both.
"""

from __future__ import annotations

import numpy as np
import torch


class WorkerAhead:
    """Registers read-ahead plans with a running mailbox worker; the host class holds `handle` (the worker),
    `layers` (its MoE layers), `device` and `_ahead_keep` (what the worker reads, kept alive as long as it runs)."""

    handle: int
    layers: list[int]
    device: torch.device
    _ahead_keep: list

    def copy_ahead(self, next_of: dict[int, int], plans: torch.Tensor, flags: torch.Tensor, stream, slots: int,
                   inter: int, hidden: int, elem: int, down_off: int, entry: tuple[int, list[int]] | None = None
                   ) -> np.ndarray | None:
        """Have the worker issue copy-ahead's tail copies on the copy engine (csrc/mailbox_ahead.h): after
        answering layer l it copies the tails planned for `next_of[l]` (plans [2, 1 + 3 * slots] int64, page-locked,
        by the planned layer's parity) on `stream` and then that plan's tag into flags[next_of[l]] (device).
        inter, hidden, elem: the experts' shape and bytes an element; down_off: down's byte offset in a slot.
        `entry`: the driver's (context, entry points) (`cuda_driver.copy_entry_points`; tests pass stand-ins).
        The copies are issued by a thread of the worker's own, which the worker only posts to (a blocked driver call
        cannot hold up its answers). Returns the copier's counters (int64 [6]: tails, bytes, late plans, driver
        errors, copies, requests dropped), None where it cannot."""
        from strata.kernels import cpu_experts as ce
        from strata.kernels import cuda_driver

        entry = entry if entry is not None else cuda_driver.copy_entry_points(self.device)
        if entry is None or not self.handle or self._ahead_keep:
            return None
        ctx, fns = entry
        handle = 0 if stream is None else int(stream.cuda_stream)
        cfg = np.array([slots, hidden, inter, elem, down_off, ctx, handle, *fns], dtype=np.int64)
        nxt = np.array([next_of.get(layer, -1) for layer in self.layers], dtype=np.int64)
        flag_host = torch.zeros((len(self.layers), 2), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        flag_dev = np.array([flags[next_of[layer]].data_ptr() if layer in next_of else 0 for layer in self.layers],
                            dtype=np.int64)
        counters = np.zeros(6, dtype=np.int64)
        if ce.mailbox_ahead(self.handle, cfg, nxt, plans.data_ptr(), flag_host.data_ptr(), flag_dev, counters) != 0:
            return None
        self._ahead_keep.extend((cfg, nxt, plans, flags, flag_host, flag_dev, counters, stream, entry))
        return counters

    def warm_ahead(self, next_of: dict[int, int], plans: torch.Tensor, slots: int, nbytes: int) -> np.ndarray | None:
        """Have the worker read ahead, once it has answered layer l, the gate/up rows of the experts copy-ahead's plan
        predicts cold in `next_of[l]` (plans [2, 1 + 3 * slots] int64, page-locked, by the planned layer's parity),
        up to `nbytes` a layer, each of its threads the rows the kernel will give it (csrc/cpu_mailbox.cpp, WarmCfg).
        Returns the worker's warm counters (int64 [8]: plans used, plans not ready, bytes read, ns reading, bytes
        of read rows computed, pieces another thread computed, ns and the longest ns a read waited for a thread of an
        earlier read still inside), None where it cannot."""
        from strata.kernels import cpu_experts as ce

        if not self.handle or self._ahead_keep:
            return None
        nxt = np.array([next_of.get(layer, -1) for layer in self.layers], dtype=np.int64)
        counters = np.zeros(8, dtype=np.int64)
        if ce.mailbox_warm(self.handle, nxt, plans.data_ptr(), slots, int(nbytes), counters) != 0:
            return None
        self._ahead_keep.extend((nxt, plans, counters))
        return counters

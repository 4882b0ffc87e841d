"""The Engram layers' per-sequence state, held by the KV cache (`KVCache.engram`)."""

from __future__ import annotations

import torch

from strata.runtime.model.engram.hashing import EngramConfig


class EngramCache:
    """Per-slot Engram state on the device: raw token ids (int64 [slots, max_len], the n-gram history)
    and per layer the ring of the last `conv_window` normalised values ([slots, conv_window, H] in the
    model dtype). The history lives on the device so that decode steps can hash inside a CUDA graph."""

    def __init__(self, cfg: EngramConfig, hidden: int, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.window = cfg.conv_window
        self.tokens = torch.zeros(num_slots, max_len, dtype=torch.int64, device=device)
        self.conv = {layer: torch.zeros(num_slots, max(self.window, 1), hidden, dtype=dtype, device=device)
                     for layer in cfg.layer_ids}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv.values())

"""The shell of a model built from its own layers rather than `MoETransformer`'s: gpt-oss and Qwen3.5-MoE.

It holds what every such model has around its own layers: the token embedding, the final norm and LM head, the
rotary table, the layer observer, the kernel options and torch's threads for a CPU prompt pass. A model subclasses
it, passing its layers and final norm; `run_layers` feeds each layer (x, cos, sin, batch, its cache).

Its layers take a `DecodeBatch` (one token a sequence, fixed shapes over a `kv_len` bucket) as well as a
`StepBatch`: `enable_decode_graphs` (which the build calls on CUDA) sets up `DecodeGraphs`, as `MoETransformer`'s
does, and a CUDA decode step runs through it as a DecodeBatch. The class switch `decode_graphs` says whether those
steps may be captured in CUDA graphs as the build's mode says ("full", "segmented", ...); off, `DecodeGraphs` is
told no mode and every step runs eagerly (its hooks are then never called).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.kernels.options import DEFAULT as DEFAULT_KERNELS
from strata.kernels.options import KernelOptions, kernel_options
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.graphs import DecodeGraphs, is_decode
from strata.runtime.model.hooks import GraphStepHooks, LayerObserver
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import linear, use_pass_threads
from strata.runtime.model.rope import RotaryEmbedding


class EagerTransformer(nn.Module):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32."""

    decode_graphs = True  # its DecodeBatch decode steps may be captured in CUDA graphs (see the module's docstring)

    def __init__(self, cfg: ModelConfig, layers: nn.ModuleList, norm: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers
        self.norm = norm
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope)  # the loader replaces it on the model's device
        self.layer_observer: LayerObserver | None = None
        self.graphs: DecodeGraphs | None = None  # DecodeBatch decode steps on CUDA (`enable_decode_graphs`)
        self.engram = None
        self.kernel_options: KernelOptions = DEFAULT_KERNELS
        self.prompt_threads = torch.get_num_threads()  # torch's threads for a CPU prompt pass (`use_pass_threads`)

    def forward(self, input_ids: torch.Tensor, batch: StepBatch | DecodeBatch, cache) -> torch.Tensor:
        use_pass_threads(input_ids, self.prompt_threads)
        with kernel_options(self.kernel_options):
            if self.graphs is not None and is_decode(input_ids, batch):  # a CUDA decode step: as a DecodeBatch
                return self.graphs.run(input_ids, batch, cache)
            return self.run_layers(input_ids, batch, cache)

    def run_layers(self, input_ids: torch.Tensor, batch: StepBatch | DecodeBatch, cache) -> torch.Tensor:
        """input_ids [N] -> final hidden states [N, H] (a StepBatch, or a DecodeBatch of one token a sequence)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(batch.positions(input_ids.device), x.dtype)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
            x = layer(x, cos, sin, batch, layer_cache)
            if self.layer_observer is not None:
                self.layer_observer.after_layer(i, x)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab] fp32."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)

    def observe_layers(self, observer: LayerObserver | None) -> None:
        """Tell `observer` after every decoder layer (None: nobody)."""
        self.layer_observer = observer

    def enable_decode_graphs(self, mode: Callable[[], str | None] = lambda: "full",
                             devices: list[torch.device] | None = None, hooks: GraphStepHooks | None = None) -> None:
        """`MoETransformer.enable_decode_graphs`'s arguments (CUDA only): decode steps run through `DecodeGraphs` as
        DecodeBatch steps, captured as `mode()` says where `decode_graphs`, else eagerly whatever `mode` says."""
        self.graphs = DecodeGraphs(self.run_layers, mode if self.decode_graphs else lambda: None, devices, hooks)

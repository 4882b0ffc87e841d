"""The decoder-only MoE transformer shared by every supported architecture.

One `nn.Module`, configured by `ModelConfig`: embeddings, N decoder layers (GQA or MLA attention;
dense MLP or sparse MoE), final norm, LM head. It runs the flat token batch of a `StepBatch`
against a `KVCache`, so prefill chunks and decode steps of several sequences share one code path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.kernels.options import DEFAULT as DEFAULT_KERNELS
from strata.kernels.options import KernelOptions, kernel_options
from strata.runtime.model.attention import GQAAttention, MLAAttention
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.engram.layer import EngramLayer, EngramRuntime
from strata.runtime.model.graphs import DecodeGraphs, is_decode
from strata.runtime.model.hooks import GraphStepHooks, LayerObserver
from strata.runtime.model.kv_cache import DecodeBatch, KVCache, StepBatch
from strata.runtime.model.layers import MLP, RMSNorm, linear, use_pass_threads
from strata.runtime.model.moe import MoEBlock
from strata.runtime.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer) if cfg.attention == "mla" else GQAAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg) if cfg.moe_layers[layer] else MLP(cfg.hidden_size, cfg.intermediate_size)
        use_engram = cfg.engram is not None and layer in cfg.engram.layer_ids
        self.engram = EngramLayer(cfg.engram, cfg.hidden_size, layer) if use_engram else None

    def forward(self, x, cos, sin, batch: StepBatch, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.engram is not None:  # Engram adds its lookup before attention (DeepSeek's block order)
            x = x + self.engram(x, batch.engram)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, batch, cache))
        if isinstance(self.mlp, MoEBlock):
            return self.mlp(h, residual=x)  # the residual added in the experts' combine launch where it runs fused
        return x + self.mlp(h)


class MoETransformer(nn.Module):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32.

    Its collaborators, each set once when the model is built: `layer_observer` (`observe_layers`: told after every
    layer, e.g. the expert prefetcher) and `graphs` (`enable_decode_graphs`: decode steps as CUDA graphs, with the
    expert executor's hooks around them); see strata.runtime.model.hooks."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.layer_observer: LayerObserver | None = None  # told after every layer (`observe_layers`)
        self.graphs: DecodeGraphs | None = None  # CUDA-graph decode steps (set up by `enable_decode_graphs`)
        self.engram = EngramRuntime(cfg.engram, cfg.vocab_size) if cfg.engram is not None else None
        # the engine's [debug] fused_kernels / pdl, in force for every kernel a forward pass launches or captures
        self.kernel_options: KernelOptions = DEFAULT_KERNELS
        self.prompt_threads = torch.get_num_threads()  # torch's threads for a CPU prompt pass (`use_pass_threads`)

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        use_pass_threads(input_ids, self.prompt_threads)
        with kernel_options(self.kernel_options):
            return self._forward(input_ids, batch, cache)

    def _forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        decode = self.graphs is not None and is_decode(input_ids, batch)
        if self.engram is not None:
            if decode and self.engram.device_steps(self.layers, len(batch.slots)):
                batch.engram = None  # the device hashes and gathers inside the step (strata.runtime.model.engram.decode)
                self.engram.device_step_queued(self.layers, len(batch.slots))
            else:  # rows depend on token ids only: start fetching them before layer 0
                batch.engram = self.engram.begin(input_ids, batch, cache, self.layers)
        if decode:
            return self.graphs.run(input_ids, batch, cache)  # fixed shapes; replayed when nothing needs the host
        return self.run_layers(input_ids, batch, cache)

    def run_layers(self, input_ids: torch.Tensor, batch: StepBatch | DecodeBatch, cache: KVCache) -> torch.Tensor:
        """The layers themselves: input_ids [N] -> final hidden states [N, H]. Engram inputs come with the
        batch when the host prepared them (`batch.engram`); otherwise they are made here (a StepBatch on
        the host, a DecodeBatch on the device)."""
        x = self.embed_tokens(input_ids)
        if self.engram is not None and batch.engram is None:
            batch.engram = self.engram.begin(input_ids, batch, cache, self.layers)
        cos, sin = self.rotary(batch.positions(input_ids.device), x.dtype)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
            x = layer(x, cos, sin, batch, layer_cache)
            if self.layer_observer is not None:
                self.layer_observer.after_layer(i, x)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab] fp32 (decode rows on the CPU: summed in fp32 and kept so, not rounded
        to the model's dtype first)."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)

    def observe_layers(self, observer: LayerObserver | None) -> None:
        """Tell `observer` after every decoder layer of each forward pass (None: nobody)."""
        self.layer_observer = observer

    def enable_decode_graphs(self, mode: Callable[[], str | None] = lambda: "full",
                             devices: list[torch.device] | None = None, hooks: GraphStepHooks | None = None) -> None:
        """Run decode steps with fixed shapes, captured in CUDA graphs as `mode()` says (CUDA only):
        "full" (nothing needs the host), "mailbox" (one graph, cold experts on the CPU worker), "segmented"
        (graphs between host steps) or None (eager). `devices`: the cards of a model split over several (a graph
        per card's stretch of layers). `hooks`: told around each graph step (the expert executor's books)."""
        self.graphs = DecodeGraphs(self.run_layers, mode, devices, hooks)

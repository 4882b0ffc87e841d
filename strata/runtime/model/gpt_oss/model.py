"""`GptOssTransformer`: gpt-oss as transformers 5.25's `GptOssForCausalLM` computes it, with `MoETransformer`'s
interface (forward over a `StepBatch` and its `KVCache`, `logits`, observers), so the engine, scheduler, planner and
tiered executor run it like the other architectures.

    x = embed(ids)                                                      [N, H]
    per layer: x = x + attention(input_layernorm(x))                    sinks; sliding window or full by layer_types
               x = x + moe(post_attention_layernorm(x))                 biased router, biased clamped SwiGLU experts
    hidden = norm(x)                                                    RMS norms with fp32 weights, rounded once

Decode steps run eagerly (no CUDA graphs: the experts' reference math groups tokens on the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.kernels.options import DEFAULT as DEFAULT_KERNELS
from strata.kernels.options import KernelOptions, kernel_options
from strata.runtime.model.config import ModelConfig
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm
from strata.runtime.model.gpt_oss.attention import GptOssAttention
from strata.runtime.model.gpt_oss.moe import GptOssMoE
from strata.runtime.model.hooks import GraphStepHooks, LayerObserver
from strata.runtime.model.kv_cache import KVCache, StepBatch
from strata.runtime.model.layers import linear, use_pass_threads
from strata.runtime.model.rope import RotaryEmbedding

FP32_NORMS = ("input_layernorm.", "post_attention_layernorm.")  # and the final norm: transformers' fp32 modules
# model parameter -> checkpoint name, where they differ: the dense expert biases sit beside the experts in the file
_BIAS_NAMES = (".mlp.expert_bias.", ".mlp.experts.")


class GptOssLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer)
        self.post_attention_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
                cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class GptOssTransformer(nn.Module):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope)  # the loader replaces it on the model's device
        self.layer_observer: LayerObserver | None = None
        self.graphs = None  # decode steps run eagerly
        self.engram = None
        self.kernel_options: KernelOptions = DEFAULT_KERNELS
        self.prompt_threads = torch.get_num_threads()  # torch's threads for a CPU prompt pass (`use_pass_threads`)

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        use_pass_threads(input_ids, self.prompt_threads)
        with kernel_options(self.kernel_options):
            return self.run_layers(input_ids, batch, cache)

    def run_layers(self, input_ids: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """input_ids [N] -> final hidden states [N, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(batch.positions(input_ids.device), x.dtype)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
            x = layer(x, cos, sin, batch, layer_cache)
            if self.layer_observer is not None:
                self.layer_observer.after_layer(i, x)
        return self.norm(x)

    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """Whether parameter `name` stays fp32 whatever the model's dtype (transformers' `_keep_in_fp32_modules`)."""
        return name == "norm.weight" or any(part in name for part in FP32_NORMS)

    @staticmethod
    def checkpoint_name(param: str) -> str:
        """Model parameter name -> its checkpoint name (transformers': under `model.` but lm_head; the dense expert
        biases as `mlp.experts.gate_up_proj_bias` / `down_proj_bias`)."""
        if param.startswith("lm_head."):
            return param
        return "model." + param.replace(*_BIAS_NAMES)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab] fp32."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)

    def observe_layers(self, observer: LayerObserver | None) -> None:
        """Tell `observer` after every decoder layer (None: nobody)."""
        self.layer_observer = observer

    def enable_decode_graphs(self, mode: Callable[[], str | None] = lambda: "full",
                             devices: list[torch.device] | None = None, hooks: GraphStepHooks | None = None) -> None:
        """gpt-oss's decode steps are not captured in CUDA graphs (its experts' reference math groups tokens by
        expert on the host): they run eagerly, whatever `mode` says."""
        self.graphs = None

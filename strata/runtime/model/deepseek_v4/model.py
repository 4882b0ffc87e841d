"""`DeepseekV4Transformer`: DeepSeek-V4 as transformers 5.25's `DeepseekV4ForCausalLM` computes it, with
`MoETransformer`'s interface (forward over a `StepBatch` and its cache, `logits`, observers), so the engine,
scheduler, planner and tiered executor run it like the other architectures.

    streams = embed(ids) repeated hc_mult times                          [N, n, H]
    per layer: post, comb, x = attn_hc(streams); streams = mix(streams, attention(input_layernorm(x)))
               post, comb, x = ffn_hc(streams);  streams = mix(streams, moe(post_attention_layernorm(x), ids))
    hidden  = norm(hc_head(streams))                                     [N, H]

A StepBatch (prompt chunks, and decode steps off CUDA) attends sequence by sequence. On CUDA, decode steps run as
`DecodeBatch` steps (fixed shapes over the step's `kv_len` bucket: strata.runtime.model.deepseek_v4.decode) through
`DecodeGraphs`, captured in CUDA graphs as the build's mode says, as `EagerTransformer`'s models are. The
multi-token-prediction layers of a checkpoint are not built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from strata.kernels.options import DEFAULT as DEFAULT_KERNELS
from strata.kernels.options import KernelOptions, kernel_options
from strata.runtime.model.config import ModelConfig, RopeConfig
from strata.runtime.model.deepseek_v4.attention import DeepseekV4Attention
from strata.runtime.model.deepseek_v4.cache import DeepseekV4Cache
from strata.runtime.model.deepseek_v4.hyper import HyperConnection, HyperHead, mix
from strata.runtime.model.deepseek_v4.moe import DeepseekV4MoE
from strata.runtime.model.deepseek_v4.norms import FloatRMSNorm
from strata.runtime.model.deepseek_v4.rope import InterleavedRope
from strata.runtime.model.graphs import DecodeGraphs, is_decode
from strata.runtime.model.hooks import GraphStepHooks, LayerObserver
from strata.runtime.model.kv_cache import DecodeBatch, StepBatch
from strata.runtime.model.layers import linear, use_pass_threads

# parameters transformers keeps in fp32 whatever the model's dtype (its _keep_in_fp32_modules_strict)
FP32_PARTS = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm.",
              "kv_norm.", "input_layernorm.", "post_attention_layernorm.")


class DeepseekV4Layer(nn.Module):
    """One decoder layer: attention and MoE, each between its hyper-connection's collapse and mix."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        s = cfg.deepseek_v4
        self.self_attn = DeepseekV4Attention(cfg, layer)
        self.mlp = DeepseekV4MoE(cfg, layer)
        self.input_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg.hidden_size, s.hc_mult, s.hc_sinkhorn_iters, s.hc_eps, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(cfg.hidden_size, s.hc_mult, s.hc_sinkhorn_iters, s.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                batch: StepBatch | DecodeBatch, cache, ropes: dict[str, InterleavedRope]) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = mix(streams, self.self_attn(self.input_layernorm(x), positions, batch, cache, ropes), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return mix(streams, self.mlp(self.post_attention_layernorm(x), token_ids), post, comb)


class DeepseekV4Transformer(nn.Module):
    """`forward(input_ids [N], batch, cache) -> hidden [N, H]`; `logits(hidden) -> [n, vocab]` fp32. Decode steps
    on CUDA run as DecodeBatch steps, captured in CUDA graphs as the build says."""

    # `EagerTransformer`'s switch (strata.runtime.model.eager): its DecodeBatch steps may be captured (hash routing
    # reads its table on the device, in-memory experts run the pair kernels on CUDA)
    decode_graphs = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        s = cfg.deepseek_v4
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, s.hc_mult, s.hc_eps, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # computed tables, also when the model is built on the meta device
            self.ropes = {"main": InterleavedRope(cfg.rope), "compress": InterleavedRope(RopeConfig(**s.compress_rope))}
        self.layer_observer: LayerObserver | None = None
        self.graphs: DecodeGraphs | None = None  # DecodeBatch decode steps on CUDA (`enable_decode_graphs`)
        self.engram = None
        self.kernel_options: KernelOptions = DEFAULT_KERNELS
        self.prompt_threads = torch.get_num_threads()  # torch's threads for a CPU prompt pass (`use_pass_threads`)

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: DeepseekV4Cache) -> torch.Tensor:
        use_pass_threads(input_ids, self.prompt_threads)
        with kernel_options(self.kernel_options):
            if self.graphs is not None and is_decode(input_ids, batch):  # a CUDA decode step: as a DecodeBatch
                return self.graphs.run(input_ids, batch, cache)
            return self.run_layers(input_ids, batch, cache)

    def run_layers(self, input_ids: torch.Tensor, batch: StepBatch | DecodeBatch, cache: DeepseekV4Cache
                   ) -> torch.Tensor:
        """input_ids [N] -> final hidden states [N, H]."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.deepseek_v4.hc_mult, -1).contiguous()  # [N, n, H]
        positions = batch.positions(input_ids.device)
        for rope in self.ropes.values():  # the layers share each positions tensor's cos/sin
            rope.begin_pass()
        try:
            for i, (layer, layer_cache) in enumerate(zip(self.layers, cache.layers, strict=True)):
                streams = layer(streams, input_ids, positions, batch, layer_cache, self.ropes)
                if self.layer_observer is not None:
                    self.layer_observer.after_layer(i, streams)
        finally:
            for rope in self.ropes.values():
                rope.end_pass()
        return self.norm(self.hc_head(streams))

    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """Whether parameter `name` stays fp32 whatever the model's dtype (transformers' strict fp32 modules)."""
        return name == "norm.weight" or any(part in name for part in FP32_PARTS)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab] fp32."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)

    def observe_layers(self, observer: LayerObserver | None) -> None:
        """Tell `observer` after every decoder layer (with the layer's streams [N, n, H]); None: nobody."""
        self.layer_observer = observer

    def enable_decode_graphs(self, mode: Callable[[], str | None] = lambda: "full",
                             devices: list[torch.device] | None = None, hooks: GraphStepHooks | None = None) -> None:
        """`EagerTransformer.enable_decode_graphs` (CUDA only): decode steps run through `DecodeGraphs` as
        DecodeBatch steps, captured as `mode()` says where `decode_graphs`, else eagerly."""
        self.graphs = DecodeGraphs(self.run_layers, mode if self.decode_graphs else lambda: None, devices, hooks)

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str
                  ) -> DeepseekV4Cache:
        """The KV cache this model runs with."""
        return DeepseekV4Cache(self.cfg, num_slots, max_len, dtype, device)

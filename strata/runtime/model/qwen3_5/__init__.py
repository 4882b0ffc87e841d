"""Qwen3.5 / 3.6 MoE (transformers' `qwen3_5_moe`): hybrid layers of Gated DeltaNet linear attention and gated full
attention, a sparse MoE with a sigmoid-gated shared expert in every layer.

    config            config.json (or a release's text_config) -> ModelConfig fields + Qwen35Settings (imported by
                      strata.runtime.model.config)
    norms             zero-centred RMS norm (1 + weight) and the gated RMS norm of the linear layers' output
    delta_rule        the causal short convolution and the gated delta rule: chunked scan (prompts), one step (decode)
    linear_attention  the Gated DeltaNet layer and its per-slot state (`LinearState`)
    attention         gated full attention with partial rotary and q/k norms
    cache             the per-sequence cache: linear layers' fixed-size state, full layers' keys and values, and its
                      size for a context (what the planner counts: strata.runtime.plan.kv_size)
    model             `Qwen35Transformer`, the MoETransformer of this architecture
"""

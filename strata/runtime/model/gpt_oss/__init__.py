"""gpt-oss (transformers' `gpt_oss`: gpt-oss-20b, gpt-oss-120b): its config, attention with sinks, MoE with biased,
clamped SwiGLU experts and the transformer built from them.

    config     config.json -> ModelConfig fields + GptOssSettings (imported by strata.runtime.model.config)
    attention  GQA with q/k/v/o biases, a sink logit per head, sliding-window or full attention by layer_types;
               keys and values cached for every position (the shared KVCache, as the planner counts it)
    moe        the biased top-k router, the experts' math (interleaved gate/up rows, biases kept dense per layer,
               alpha 1.702, limit 7.0) in memory and for the tiered executor's reference path
    layout     where the checkpoint keeps the experts: the release's MXFP4 blocks (strata's orientation) or
               transformers' bf16 tensors, transposed
    model      `GptOssTransformer`
"""

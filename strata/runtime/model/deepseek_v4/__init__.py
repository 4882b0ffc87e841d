"""DeepSeek-V4 (transformers' `deepseek_v4`): its config, attention variants, compressors and lightning indexer,
hyper-connections, hash and top-k routers, KV cache and the transformer built from them.

    config      config.json -> ModelConfig fields + DeepseekV4Settings (imported by strata.runtime.model.config)
    names       the original DeepSeek tensor names -> transformers' names
    release_quant  the quantized releases' FP8 `.scale` and FP4 expert tensors -> strata's fp8 and mxfp4 spellings
    rope        interleaved RoPE on a head's trailing slice ("main" and "compress" frequencies)
    norms       RMS norms as V4 computes them (fp32 weights, one rounding)
    compressor  CSA / HCA compressors: gated pooling of source-token windows into compressed KV entries
    indexer     the lightning indexer: top-k compressed entries per query (CSA)
    attention   shared-KV attention over the sliding window plus compressed entries, sinks, grouped output
    hyper       manifold-constrained hyper-connections (Sinkhorn-projected stream mixing) and the final collapse
    moe         sqrt-softplus top-k and hash (tid2eid) routers, clipped SwiGLU experts
    tables      the hash layers' tid2eid tables as store tables, checked and held in their tier
    cache       the KV cache: sliding-window ring, compressed entries, compressor state per sequence slot, and
                its size for a context (what the planner counts: strata.runtime.plan.kv_size)
    model       `DeepseekV4Transformer`, the MoETransformer of this architecture
"""

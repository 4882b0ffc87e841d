"""The model: its normalised config, the transformer, attention, MoE, KV cache, CUDA graphs, loading."""

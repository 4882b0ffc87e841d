"""Checkpoint loading, model architectures, KV cache, sampler and the generation loop."""

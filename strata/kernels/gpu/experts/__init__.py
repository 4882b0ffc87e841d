"""GPU expert compute (Triton): the decode pair kernels over slot-indexed experts, plain, FP8 / MXFP4 and GGUF
(`grouped` launches them), their SwiGLU forms, the quantized slots' dequantizers, and prefill's grouped GEMMs."""

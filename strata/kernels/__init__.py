"""GPU and CPU kernels: expert routing (top-k), expert matmuls, dequantization."""

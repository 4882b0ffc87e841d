"""CPU-side benchmarks: the CPU expert kernel, its quantizers, and strata against llama.cpp on a CPU-only host."""

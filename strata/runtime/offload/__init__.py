"""The tiered expert executor: cold experts computed from whichever tier holds them, on the CPU or the GPU."""

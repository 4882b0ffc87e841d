"""Benchmarks of strata on the GPU machine; `python -m bench` runs the suite (bench/suite)."""

"""The demo models: the trained default, random-weight sizes for tests and benchmarks, their tokenizer."""

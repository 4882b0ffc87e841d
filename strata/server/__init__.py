"""The OpenAI-compatible HTTP server, its metrics and the tier dashboard."""

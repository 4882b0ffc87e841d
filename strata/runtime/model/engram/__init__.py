"""Engram layers: hashed n-gram rows gated by the hidden state, their hashing, decode steps and tables."""

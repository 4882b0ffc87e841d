"""The CPU expert kernel (csrc/, C++): building it, calling it, its scheduling knobs."""

"""Planning and building what runs: the planner, host probing, several GPUs, the store cache, convert, inspect."""

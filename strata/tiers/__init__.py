"""Expert store format, tiers (GPU, pinned RAM, tmpfs, NVMe), the async tier manager and its policies."""

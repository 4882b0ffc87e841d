"""The expert store on disk: safetensors headers, the store format and its index, writing and checking stores."""

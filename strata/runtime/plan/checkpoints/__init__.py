"""What a checkpoint holds and how it becomes a store: reading its config, tensors and weight formats (`inspect`,
`gguf_inspect`, `weight_formats`), an expert's bytes in its files (`expert_sources`), packing and verifying a store
(`convert`, `gguf_convert`), where a checkpoint's store lives (`store_cache`) and serving a checkpoint's own files in
place (`in_place`). Nothing here imports the rest of strata.runtime.plan, which plans and builds on top of it."""

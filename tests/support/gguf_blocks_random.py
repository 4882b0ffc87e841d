"""Random valid GGML blocks for tests: random bytes with every f16 scale set to a small finite value, so each
block dequantizes (by `gguf`'s own code) to weights of magnitude about 0.1, as a trained model's."""

from __future__ import annotations

import numpy as np

from strata.kernels.gguf_blocks import BLOCK_TYPES

# type -> ((byte offset of an f16 scale in a block, largest |q * sub-scale| it multiplies), ...)
_SCALES = {
    "Q8_0": ((0, 127),),
    "Q2_K": ((80, 45), (82, 45)),
    "Q3_K": ((108, 128),),
    "Q4_K": ((0, 945), (2, 945)),
    "Q5_K": ((0, 1953), (2, 1953)),
    "Q6_K": ((208, 4064),),
    "IQ4_XS": ((0, 4064),),
}


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, amax: float = 0.1) -> np.ndarray:
    """uint8 [rows, k / block_values * block_bytes]: `rows` rows of `k` values in `type_name`'s blocks."""
    t = BLOCK_TYPES[type_name]
    blocks = rng.integers(0, 256, size=(rows, k // t.block_values, t.block_bytes), dtype=np.uint8)
    for offset, reach in _SCALES[type_name]:
        d = rng.uniform(0.5, 1.0, size=blocks.shape[:2]).astype(np.float16) * np.float16(amax / reach)
        blocks[:, :, offset : offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)

"""Where the fused Triton kernels' tests run: on CUDA in bf16 (marked gpu), else under Triton's interpreter on the CPU
in fp16 when it is on (STRATA's interpreted-kernel runs), else nowhere (the gpu mark skips the module)."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.gpu import fused

if torch.cuda.is_available():
    DEVICE, DTYPE, MARKS = "cuda", torch.bfloat16, [pytest.mark.gpu]
elif fused._INTERPRET and fused.triton is not None:
    DEVICE, DTYPE, MARKS = "cpu", torch.float16, []
else:
    DEVICE, DTYPE, MARKS = "cpu", torch.float16, [pytest.mark.gpu]

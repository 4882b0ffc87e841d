"""What building a model gives the engine (`LoadedModel`), and the settings every build resolves the same way
(one card: strata.runtime.plan.build; several: strata.runtime.plan.multi_device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.config import StrataConfig
from strata.errors import StrataError
from strata.kernels.options import KernelOptions
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.moe import Experts
from strata.runtime.model.transformer import MoETransformer
from strata.runtime.offload.executor import ExpertExecutor
from strata.runtime.plan.planner import Plan
from strata.tiers.manager import TierManager

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # runtime.dtype's names


@dataclass
class LoadedModel:
    """Everything `Engine` runs: the model, where it runs, and (tiered) its plan, tier manager and expert executor
    (`ExpertCompute` on one card, `StagedCompute` over several)."""

    checkpoint: Checkpoint
    model: MoETransformer
    device: torch.device
    dtype: torch.dtype
    max_context: int
    plan: Plan | None = None
    manager: TierManager | None = None
    compute: ExpertExecutor | None = None


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; a CUDA request without CUDA is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise StrataError(f"device {device!r} requested but no CUDA GPU is available; use --device cpu")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise StrataError(f"device {device!r} does not exist: this host has {torch.cuda.device_count()} GPU(s)")
    elif device != "cpu":
        raise StrataError(f"device {device!r} is invalid; use auto, cpu, cuda or cuda:N")
    return torch.device(device)


def kernel_options_of(cfg: StrataConfig) -> KernelOptions:
    """The kernels' options an engine's forward passes run with (`[debug] fused_kernels`, `pdl`, `cpu_threads`)."""
    return KernelOptions(fused=cfg.debug.fused_kernels, pdl=cfg.debug.pdl, cpu_threads=cfg.debug.cpu_threads or None)


def grouped_on(setting: bool | str, device: torch.device) -> bool:
    """[debug] grouped_prefill resolved for `device`: "auto" means on CUDA only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def use_grouped_prefill(model, on: bool) -> None:
    """[debug] grouped_prefill for a model whose experts are all in memory: each layer's `Experts`."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = on

"""The context a sequence gets: `runtime.max_context`, a number of tokens or "auto" (the default).

"auto" is the model's own limit (`max_position_embeddings`) when the KV cache for every sequence slot at that
length takes at most `AUTO_KV_SHARE` of the memory the compute device has left after the non-expert weights and
the activation reserve (what the KV cache shares with expert slots: a longer context costs experts their GPU
room). Past that share the context is the longest multiple of `AUTO_STEP` tokens that fits it, but not below
`AUTO_FLOOR` (or the model's limit) while half the memory holds that many; a host with less gets what half its
memory holds (at least `MIN_CONTEXT`), and the planner refuses one where even that does not fit, as it would a
number the user set.

    context, note = plan_context("auto", 40960, kv_bytes_per_token, room)   # the planner's (strata plan shows it)

A model loaded whole (`runtime.experts = "memory"`, no planner) is checked first: `check_whole_fits` refuses it on a
GPU whose free memory does not hold its weights and the activation reserve, before anything is loaded, and
`check_kv_fits` one whose KV cache for the context would not fit beside them.
"""

from __future__ import annotations

import math
from typing import Any

import psutil
import torch

from strata.runtime.plan.checkpoints.inspect import format_bytes
from strata.runtime.plan.kv_size import kv_growth_of
from strata.runtime.plan.layout import PlanError
from strata.runtime.plan.stages import layer_sizes

AUTO_KV_SHARE = 0.25  # of the memory left after the weights, the most an automatic context's KV cache takes
AUTO_STEP = 1024  # an automatic context below the model's limit is a multiple of this many tokens
AUTO_FLOOR = 4096  # ... and at least this many (or the model's limit) where half the memory holds them
MIN_CONTEXT = 16  # runtime.max_context's lower bound


def plan_context(setting: int | str, model_limit: int, kv_bytes_per_token: int, room: int | None) -> tuple[int, str]:
    """(tokens, a line for the plan saying where they come from) for `runtime.max_context` = `setting`.

    `kv_bytes_per_token`: the KV cache's bytes per token of context, all sequence slots together; `room`: the
    bytes the compute device has for the KV cache and experts (None: unknown, the model's limit is taken)."""
    if setting != "auto":
        context = min(int(setting), model_limit)
        if context < int(setting):
            return context, f"runtime.max_context {setting} is capped at the model's {context}"
        return context, f"context {context} tokens (runtime.max_context)"
    if room is None or kv_bytes_per_token <= 0:
        return model_limit, f"context {model_limit} tokens: the model's limit (runtime.max_context \"auto\")"
    room = max(0, room)
    fits = int(room * AUTO_KV_SHARE) // kv_bytes_per_token
    if fits >= model_limit:
        return model_limit, f"context {model_limit} tokens: the model's limit (runtime.max_context \"auto\")"
    if fits < min(AUTO_FLOOR, model_limit):  # up to the floor, from half the memory
        fits = min(AUTO_FLOOR, model_limit, room // 2 // kv_bytes_per_token)
    step = AUTO_STEP if fits >= AUTO_STEP else MIN_CONTEXT
    context = max(MIN_CONTEXT, fits // step * step)
    return context, (f"context {context} tokens (runtime.max_context \"auto\"): the model's {model_limit} would give "
                     f"the KV cache more than {AUTO_KV_SHARE:.0%} of the memory left after the weights; set "
                     "runtime.max_context to choose another")


def sequence_slots(cfg: Any, model_config: Any) -> int:
    """The KV cache's sequence slots of a model loaded whole: `planner.max_batch`, plus the prefix cache's own
    (`runtime.prefix_only_slots`; none for Qwen3.5, whose linear-attention state serves no other prompt's prefix)."""
    return cfg.planner.max_batch + (cfg.runtime.prefix_only_slots if model_config.qwen3_5 is None else 0)


def loaded_context(cfg: Any, model_config: Any, device: torch.device, dtype: torch.dtype) -> int:
    """The context of a model loaded whole, without a plan (`runtime.experts = "memory"`): "auto" measured
    against what the device has free once the weights are loaded (the host's available RAM on the CPU)."""
    setting = cfg.runtime.max_context
    slots = sequence_slots(cfg, model_config)
    fixed, rate = kv_growth_of(model_config, dtype)
    kv = math.ceil(rate) * slots
    room = None
    if setting == "auto":
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        room = free - cfg.planner.activation_reserve_bytes - fixed * slots
    return plan_context(setting, model_config.max_position_embeddings, kv, room)[0]


def check_kv_fits(cfg: Any, model_config: Any, device: torch.device, dtype: torch.dtype, context: int) -> None:
    """Once a whole model's weights are on `device` (one GPU): a `PlanError` where the KV cache of every sequence
    slot at `context` tokens, allocated at start-up, does not fit what is left beside the activation reserve."""
    if device.type != "cuda":
        return
    slots = sequence_slots(cfg, model_config)
    fixed, rate = kv_growth_of(model_config, dtype)
    need = fixed * slots + math.ceil(rate) * slots * context
    room = torch.cuda.mem_get_info(device)[0] - cfg.planner.activation_reserve_bytes
    if need > room:
        raise PlanError(
            f"the KV cache of {slots} sequences at {context} tokens takes {format_bytes(need)} on {device}, which has "
            f"{format_bytes(max(0, room))} left after the weights and the activation reserve; lower "
            "runtime.max_context or planner.max_batch, or serve the model from the tiers (runtime.experts = \"tiered\")")


def whole_model_bytes(checkpoint: Any, dtype: torch.dtype) -> int:
    """The bytes of every weight of `checkpoint`'s model loaded whole in `dtype`: routed experts and Engram tables
    included, quantized experts dequantized to `dtype` (as the reference path loads them), an LM head the loader ties
    to the embeddings (the checkpoint has none of its own) counted once."""
    sizes = layer_sizes(checkpoint.config, dtype, experts=True)
    tied = checkpoint.config.tie_word_embeddings and not checkpoint.has("lm_head.weight")
    return sum(sizes.layer_bytes) + sizes.embed_bytes + sizes.head_bytes - (sizes.embed_bytes if tied else 0)


def check_whole_fits(cfg: Any, checkpoint: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Raises `PlanError` where `device` (a GPU) has less memory free than the whole model's weights in `dtype` and
    `planner.activation_reserve`, which loading it would exhaust part-way. On the CPU the weights are read through
    the page cache, so nothing is refused there."""
    if device.type != "cuda":
        return
    need = whole_model_bytes(checkpoint, dtype)
    free = torch.cuda.mem_get_info(device)[0]
    reserve = cfg.planner.activation_reserve_bytes
    if need + reserve > free:
        raise PlanError(
            f"runtime.experts = \"memory\" loads every weight onto {device}: {format_bytes(need)} in {dtype} "
            f"(quantized experts dequantized) and the {format_bytes(reserve)} activation reserve, with "
            f"{format_bytes(free)} free; serve it from the tiers instead (runtime.experts = \"tiered\", the default)")

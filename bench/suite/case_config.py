"""The strata config a suite case runs with: its variant's settings, its GPU and RAM budgets, the context and prefill
chunk its group's workloads need, then any `--set` override."""

from __future__ import annotations

import copy

from bench.suite.cases import VARIANTS, Case, Workload


def prefill_chunk(prompts: list[int], token_budget: int) -> int:
    """The prompt tokens a prefill pass takes in the suite: a prompt alone prefills in chunks of
    runtime.prefill_chunk (the scheduler's idle budget), set to the longest prompt, up to 8192 tokens (at least the
    scheduler's token budget), so each cold expert crosses PCIe once per prompt. llama.cpp's cases batch prompts the
    same (llamacpp_case)."""
    return max(token_budget, min(max(prompts), 8192))


def engine_config(case: Case, summary: dict, settings: dict, workloads: list[Workload]) -> dict:
    """The strata.config dict for `case` (sections as in config.toml). The ceiling (every expert in VRAM) loads plain
    experts into the model (`runtime.experts = "memory"`) and gives quantized ones (summary's `experts_quantized`) a
    GPU slot each in their format."""
    expert_total = summary["expert_bytes_total"]
    longest = max(w.prompt + w.tokens for w in workloads)
    chunk = prefill_chunk([w.prompt for w in workloads], settings["token_budget"])
    cfg: dict = {
        # prompts repeat between the warm-up and the timed run: the prefix cache would serve them (bench/agent_replay.py
        # measures it), so every prompt here is computed
        "runtime": {"max_context": max(1024, longest + 64), "prefill_chunk": chunk, "prefix_cache": False},
        "tiers": {"disk": {"path": settings["cache"], "scrub": False}},
        "planner": {"max_batch": max(w.streams for w in workloads)},
    }
    _merge(cfg, VARIANTS[case.variant])
    _merge(cfg, case.extra)
    if case.gpu_fraction is not None and case.variant != "ceiling":
        cfg["tiers"].setdefault("gpu", {})["budget"] = str(int(expert_total * case.gpu_fraction))
    if case.ram_fraction is not None:  # the NVMe case: a store on real disk, RAM below the expert bytes
        cfg["tiers"]["pinned"] = {"budget": str(int(expert_total * case.ram_fraction))}
        cfg["tiers"]["disk"]["path"] = settings["disk_cache"]
    _merge(cfg, settings.get("set") or {})  # --set: an A/B run's override, last
    if case.variant == "ceiling" and summary.get("experts_quantized"):
        # `runtime.experts = "memory"` loads quantized experts dequantized to the compute dtype: bf16's bytes and
        # kernels. Quantized, every expert instead takes a GPU slot in its own format (the tiers' default budget
        # holds them all where VRAM does; a --set budget, such as the quant step's 25% of bf16's bytes, is for the
        # tiered cases), read by the quantized pair kernels.
        cfg["runtime"]["experts"] = "tiered"
        cfg["tiers"].get("gpu", {}).pop("budget", None)
    return cfg


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict):
            _merge(dst.setdefault(k, {}), v)
        else:
            dst[k] = copy.deepcopy(v)

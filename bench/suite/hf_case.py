"""The baseline a Python user tries first: transformers + accelerate offload of the same checkpoint.

`device_map="auto"` with `max_memory` = the non-expert weights plus the same expert budget strata
gets on the GPU (the rest of the model stays in CPU RAM and accelerate moves it to the GPU layer by
layer, every forward pass), greedy decoding. A first generate of one token (prefill + first token)
and one of three tokens estimate the cost; the decode run is then cut to what fits in `limit_s`,
and the case is skipped, with the estimate as the reason, when even the prefill does not fit.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

from bench.suite.cases import Case
from bench.suite.strata_case import _Peaks, prompts_for, record


def run_hf(case: Case, model: Path, summary: dict, settings: dict, limit_s: float, log=print) -> dict:
    """transformers + accelerate on `case` (see `_run_hf`), with transformers' Hub kernels off: the baseline is its own
    PyTorch code, as an offline machine runs it (with the `kernels` package installed, transformers 5.x fetches a
    rotary kernel from the Hub and, unable to verify its publisher offline, refuses to load the model)."""
    before = os.environ.get("USE_HUB_KERNELS")
    os.environ["USE_HUB_KERNELS"] = "NO"
    try:
        return _run_hf(case, model, summary, settings, limit_s, log)
    finally:
        if before is None:
            os.environ.pop("USE_HUB_KERNELS", None)
        else:
            os.environ["USE_HUB_KERNELS"] = before


def _run_hf(case: Case, model: Path, summary: dict, settings: dict, limit_s: float, log=print) -> dict:
    """One HF baseline record (skipped with a reason when it cannot run or would take too long)."""
    try:
        import accelerate  # noqa: F401 - device_map offload needs it
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return record(case, "skipped", f"transformers/accelerate not importable here ({e})")
    device = settings["device"]
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return record(case, "skipped", "the accelerate offload baseline needs a CUDA GPU")
    if limit_s < 60:
        return record(case, "skipped", f"only {limit_s:.0f} s left before the suite's deadline")
    w = case.workload
    if w.streams != 1:
        return record(case, "skipped", "the HF baseline is measured for one stream")
    gpu_bytes = summary["non_expert_bytes"] + int(summary["expert_bytes_total"] * (case.gpu_fraction or 0))
    max_memory = {0: gpu_bytes + (2 << 30), "cpu": "1000GiB"}  # + 2 GiB for activations, as strata's planner reserves
    t0 = time.perf_counter()
    model_hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map="auto",
                                                    max_memory=max_memory)
    load_s = time.perf_counter() - t0
    peaks = _Peaks(device)
    try:
        ids = torch.tensor([prompts_for(w, summary.get("vocab_size", 8192))[0]], device="cuda:0")

        def gen(n: int) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            model_hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        peaks.reset()
        first = gen(1)  # prefill + first token (also the warm-up)
        left = limit_s - (time.perf_counter() - t0)
        if 2 * first > left:
            return record(case, "skipped", f"prefill + first token took {first:.1f} s; a decode run would not fit in "
                                           f"the {limit_s:.0f} s allowed", metrics={"ttft_s": round(first, 2)})
        three = gen(3)
        per_token = max(1e-3, (three - first) / 2)
        n = int(min(w.tokens, max(3, (left - first - three) / per_token * 0.8)))
        total = gen(n) if n > 3 else three
        n = max(n, 3)
        decode = (n - 1) / max(1e-6, total - first)
        metrics = {"tokens": n, "decode_tok_s": round(decode, 4), "slowest_stream_tok_s": round(decode, 4),
                   "prefill_tok_s": round(w.prompt / first, 2), "ttft_s": round(first, 3),
                   "estimated_s_for_all_tokens": round(first + per_token * (w.tokens - 1), 1),
                   "load_s": round(load_s, 1), "max_memory_gpu_bytes": max_memory[0],
                   "gpu_hit_rate": None, "bytes_per_token": {}, "cpu_experts_per_token": None,
                   "stall_s_per_token": None, **peaks.read()}
        note = None if n >= w.tokens else f"decode measured over {n} of {w.tokens} tokens to stay within {limit_s:.0f} s"
        rec = record(case, "ok", None, metrics=metrics, roofline=None, fraction_of_roofline=None, note=note,
                     config={"device_map": "auto", "max_memory": {"0": max_memory[0], "cpu": max_memory["cpu"]},
                             "dtype": "bfloat16", "decoding": "greedy"})
        log(f"{case.name}: decode {metrics['decode_tok_s']} tok/s, ttft {metrics['ttft_s']} s ({note or 'all tokens'})")
        return rec
    finally:
        model_hf = None  # noqa: F841 - drop the last reference before freeing the cache
        gc.collect()
        torch.cuda.empty_cache()

"""strata on the GGUF file a llama.cpp variant reads (variant `split-q4_k_m`): both engines' Q4_K_M rows on the
same weights, at the same GPU budget.

The file: the routing's bf16 checkpoint exported by `llamacpp_case.ensure_gguf` under the llama.cpp root, the very
file `llamacpp-q4_k_m` reads (whichever case comes first writes it; the other finds it on disk). strata loads it as
any GGUF (its store keeps the routed experts in the file's ggml blocks).

The budget: the case's fraction of the file's routed-expert bytes (`layer_expert_bytes`, the tensors llama.cpp's
--n-cpu-moe places), the bytes `cpu_moe_layers` takes llama.cpp's fraction of. At b25 strata gets 25% of the Q4_K_M
experts' bytes, not 25% of the bf16 checkpoint's, which are over three times as many.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.suite.case_config import engine_config
from bench.suite.cases import STRATA_GGUF_VARIANTS, Case
from bench.suite.llamacpp_case import ensure_gguf, layer_expert_bytes
from bench.suite.models import model_facts
from bench.suite.roofline import ModelFacts, Rates
from bench.suite.strata_case import record, run_group


def gguf_model(case: Case, checkpoint: Path, settings: dict, log=print) -> tuple[Path, ModelFacts, dict]:
    """(GGUF path, roofline facts, summary) of the file strata runs `case` on: `checkpoint` exported as the case's
    export type (once, under the llama.cpp root). The summary's `expert_bytes_total`, on which
    `case_config.engine_config` takes the budget fraction, is the file's routed-expert bytes; its routing marker and
    vocabulary are `checkpoint`'s (the file lies outside the suite's models directory, where `gguf_source` looks)."""
    export = STRATA_GGUF_VARIANTS[case.variant]
    gguf = ensure_gguf(Path(checkpoint), export, settings, log)
    facts, summary = model_facts(gguf, source=Path(checkpoint))
    return gguf, facts, {**summary, "expert_bytes_total": sum(layer_expert_bytes(gguf).values()), "export": export}


def gpu_budget_bytes(case: Case, summary: dict) -> int | None:
    """The GPU expert budget in bytes `engine_config` gives `case` on `summary`'s model (None: every expert in VRAM)."""
    if case.gpu_fraction is None or case.variant == "ceiling":
        return None
    return int(summary["expert_bytes_total"] * case.gpu_fraction)


def store_note(gguf: Path, config: dict) -> str | None:
    """A line saying that loading `gguf` converts it into a store first (None when its store is on disk): the
    conversion reads the whole file, which takes minutes at the bench size."""
    from strata.config import load_config
    from strata.runtime.plan.checkpoints.store_cache import store_dir_for
    from strata.tiers.store.format import is_store

    store = store_dir_for(gguf, load_config(config))
    return None if is_store(store) else f"loading {gguf}: converting it into its store {store} (not on disk yet)"


def run_strata_gguf_group(group: list[Case], checkpoint: Path, rates: Rates, settings: dict, deadline: float,
                          log=print, popularity: dict | None = None) -> list[dict]:
    """Records for one group of a strata GGUF variant (one routing and budget): skipped when the routing's model is
    not a bf16 checkpoint (the export starts from one), else `strata_case.run_group` on the exported file. Each
    record's `gguf` names the file, its source, its routed-expert bytes and the GPU budget in bytes."""
    first = group[0]
    if settings.get("experts", "bf16") != "bf16" or Path(checkpoint).suffix == ".gguf":
        why = settings.get("experts") if settings.get("experts", "bf16") != "bf16" else Path(checkpoint).name
        return [record(c, "skipped", f"the GGUF export starts from bf16 checkpoints, not {why}") for c in group]
    t0 = time.perf_counter()
    gguf, facts, summary = gguf_model(first, checkpoint, settings, log)
    export_s = round(time.perf_counter() - t0, 1)
    budget, total = gpu_budget_bytes(first, summary), summary["expert_bytes_total"]
    note = store_note(gguf, engine_config(first, summary, settings, [c.workload for c in group]))
    if note:
        log(note)
    log(f"{first.variant}/{first.budget_label}/{first.routing}: strata on {gguf.name}, GPU budget "
        f"{'all' if budget is None else f'{budget / 1e9:.3f}'} of {total / 1e9:.3f} GB of routed experts")
    recs = run_group(group, gguf, summary, facts, rates, settings, deadline, log, popularity)
    about = {"path": str(gguf), "source": str(checkpoint), "experts": summary["export"], "expert_bytes_total": total,
             "gpu_budget_bytes": budget, "export_s": export_s}
    return [{**r, "gguf": about} for r in recs]

"""Run a list of cases in order, one engine per group, within a deadline; write the JSON as it goes."""

from __future__ import annotations

import time
from pathlib import Path

from bench.suite import results
from bench.suite.cases import LLAMACPP_VARIANTS, STRATA_GGUF_VARIANTS, Case, group_by_engine
from bench.suite.hf_case import run_hf
from bench.suite.llamacpp_case import run_llamacpp_cases, start_llamacpp
from bench.suite.models import ensure_model, model_facts, routing_of
from bench.suite.roofline import Rates, measure_rates
from bench.suite.serve_case import run_serve
from bench.suite.strata_case import record, run_group
from bench.suite.strata_gguf_case import run_strata_gguf_group


def run_suite(cases: list[Case], settings: dict, out_dir: str | Path, log=print, rates: Rates | None = None) -> dict:
    """Measure `cases`; returns the result document (also written to out_dir/suite.json after every group).

    settings: device, cache, disk_cache, models_dir, size, layers, skew, experts (the demo models' expert format),
    model (a checkpoint to use instead of writing demo models), token_budget, placement_timeout, deadline_s,
    hf_limit_s, suite; llamacpp_src, llamacpp_bin, llamacpp_root, llamacpp_threads (the llamacpp baseline).
    llama.cpp's cases run last, so that its tools build (when they must) while strata's cases run; strata's cases on
    a llama.cpp GGUF (`split-q4_k_m`) export it, so llama.cpp's cases of that export find it on disk.
    """
    start = time.time()
    deadline = start + settings["deadline_s"]
    out_dir = Path(out_dir)
    rates = rates or measure_rates(settings["device"])
    doc = results.new_document(settings.get("suite", "custom"), settings, results.machine_info(), rates.as_dict())
    models = _models(cases, settings, doc, log)
    results.write(doc, out_dir)
    groups = group_by_engine(cases)
    groups = [g for g in groups if g[0].variant not in LLAMACPP_VARIANTS] + [
        g for g in groups if g[0].variant in LLAMACPP_VARIANTS]
    llamacpp_tools = start_llamacpp(settings, log) if any(g[0].variant in LLAMACPP_VARIANTS for g in groups) else None
    for group in groups:
        first = group[0]
        if first.routing not in models:
            doc["cases"] += [record(c, "skipped", f"no {c.routing} checkpoint (--model gives one routing)")
                             for c in group]
            continue
        model, facts, summary = models[first.routing]
        left = deadline - time.time()
        if left < 20:
            doc["cases"] += [record(c, "skipped", "the suite's deadline passed (--deadline)") for c in group]
            continue
        log(f"--- {first.variant} / {first.budget_label} / {first.routing}: {len(group)} case(s), {left:.0f} s left")
        if first.variant == "hf" and settings.get("experts", "bf16") != "bf16":
            doc["cases"] += [record(c, "skipped", f"the transformers baseline runs bf16 checkpoints only, not "
                                                  f"{settings['experts']}") for c in group]
            continue
        try:
            if first.variant == "hf":
                doc["cases"] += [run_hf(c, model, summary, settings, min(settings["hf_limit_s"], left - 10), log)
                                 for c in group]
            elif first.variant in LLAMACPP_VARIANTS:
                doc["cases"] += run_llamacpp_cases(group, model, llamacpp_tools, settings, left - 10, log)
            elif first.variant == "serve":
                for c in group:
                    doc["cases"].append(run_serve(c, model, summary, settings, out_dir, min(120.0, left - 10)))
                    rec = doc["cases"][-1]
                    log(f"{c.name}: {rec['metrics'] if rec['status'] == 'ok' else rec['status']} "
                        f"({rec.get('warmup') or rec.get('reason')})")
            else:
                pop = doc["models"][first.routing].setdefault("popularity", {})
                pop = None if pop else pop  # measured once per routing, on its first strata engine
                if first.variant in STRATA_GGUF_VARIANTS:  # strata on the GGUF file a llama.cpp variant reads
                    doc["cases"] += run_strata_gguf_group(group, model, rates, settings, deadline, log, popularity=pop)
                else:
                    doc["cases"] += run_group(group, model, summary, facts, rates, settings, deadline, log,
                                              popularity=pop)
        except Exception as e:  # noqa: BLE001 - an engine that does not load fails its cases, not the suite
            doc["cases"] += [record(c, "error", f"{type(e).__name__}: {e}") for c in group]
            log(f"{first.name}: error {type(e).__name__}: {e}")
        doc["elapsed_s"] = round(time.time() - start, 1)
        results.write(doc, out_dir)
    return doc


def _models(cases: list[Case], settings: dict, doc: dict, log) -> dict:
    """routing -> (checkpoint dir, ModelFacts, summary) for the routings `cases` need."""
    out = {}
    if settings.get("model"):
        routing, why = routing_of(Path(settings["model"]))
        facts, summary = model_facts(Path(settings["model"]))
        doc["models"][routing] = {**summary, "routing_note": why}
        return {routing: (Path(settings["model"]), facts, summary)}
    for routing in dict.fromkeys(c.routing for c in cases):
        t0 = time.perf_counter()
        path = ensure_model(Path(settings["models_dir"]), settings["size"], settings["layers"], routing,
                            settings["skew"], progress=settings.get("progress", True),
                            locality=settings.get("locality", 0.0), experts=settings.get("experts", "bf16"), log=log)
        facts, summary = model_facts(path)
        doc["models"][routing] = {**summary, "ready_s": round(time.perf_counter() - t0, 1),
                                  "route_skew": "uniform" if routing == "uniform" else settings["skew"]}
        if routing != "uniform" and settings.get("locality"):
            doc["models"][routing]["route_locality"] = settings["locality"]
        log(f"{routing} model: {path} ({summary['total_bytes'] / 1e9:.1f} GB)")
        out[routing] = (path, facts, summary)
    return out

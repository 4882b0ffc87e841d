"""The report's table "strata against llama.cpp": each of llama.cpp's GGUF exports against strata on the same weights,
routing, GPU budget and workload (bench/suite/llamacpp_case.py runs llama.cpp), ratios from one run."""

from __future__ import annotations

from bench.suite.cells import ACROSS, by_name, decode_tok_s, fmt, pair

LLAMACPP = (("llamacpp", "bf16"), ("llamacpp-q4_k_m", "Q4_K_M"))
LABELS = tuple(label for _, label in LLAMACPP)
PREFILL_WORKLOADS = ("p512x1", "p8192x1")  # judged on prefill tok/s; the others on decode tok/s
FALLBACK = " (strata bf16)"  # a Q4_K_M ratio taken against strata's bf16 run: no strata Q4_K_M case measured


def llamacpp_rows(doc: dict) -> list[dict]:
    """strata against llama.cpp on the same checkpoint, routing, budget and workload, each of llama.cpp's GGUF
    exports against strata on the same weights (`cases.STRATA_TWIN`): its bf16 GGUF against strata's bf16 checkpoint
    (`split`), its Q4_K_M GGUF against strata on that very file (`split-q4_k_m`), or, where no such case was measured,
    against strata's bf16 run (then `strata_weights` is "bf16", not the export's). {name, routing, budget, workload,
    measure ("decode" | "prefill"), strata (the bf16 run's tok/s), strata_q4_k_m, llamacpp: per export {tok_s, ratio,
    same_run, placement, strata_tok_s, strata_weights, vram, strata_vram}}, the ratios strata / llama.cpp from one
    run where one measured both (`pair`)."""
    from bench.suite.cases import STRATA_TWIN

    cases = by_name(doc)
    # strata's twins: per export as STRATA_TWIN says, but all in VRAM (budget "all") bf16 is the `ceiling` variant
    keys = dict.fromkeys(c["name"].split("/", 1)[1] for c in doc["cases"]
                         if c["variant"] in STRATA_TWIN.values() or c["variant"] == "ceiling")
    out = []
    for key in keys:  # budget/routing/workload
        budget, routing, workload = key.split("/", 2)
        measure = "prefill" if workload.split("@")[0] in PREFILL_WORKLOADS else "decode"
        row = {"name": f"split/{key}", "routing": routing, "budget": budget, "workload": workload, "measure": measure,
               "strata": None, "strata_q4_k_m": None, "llamacpp": {}}
        for variant, label in LLAMACPP:
            ours_variant, weights = STRATA_TWIN[variant], label
            bf16 = "ceiling" if budget == "all" else "split"
            ours_variant = bf16 if ours_variant == "split" else ours_variant
            if decode_tok_s(cases.get(f"{ours_variant}/{key}")) is None and ours_variant != bf16:
                ours_variant, weights = bf16, "bf16"
            a, b, same = pair(doc, f"{ours_variant}/{key}", f"{variant}/{key}")
            if decode_tok_s(b) is None:
                continue
            ours, theirs = a["metrics"].get(f"{measure}_tok_s") if decode_tok_s(a) else None, b["metrics"].get(f"{measure}_tok_s")
            row["llamacpp"][label] = {"tok_s": theirs, "ratio": ours / theirs if ours and theirs else None,
                                      "same_run": same, "placement": _placement(b.get("config") or {}),
                                      "strata_tok_s": ours, "strata_weights": weights,
                                      "vram": b["metrics"].get("peak_vram_bytes"),
                                      "strata_vram": a["metrics"].get("peak_vram_bytes") if decode_tok_s(a) else None,
                                      "kv": b["metrics"].get("kv_reserved_bytes"),
                                      "strata_kv": a["metrics"].get("kv_reserved_bytes") if decode_tok_s(a) else None}
            key_of = "strata" if weights == "bf16" else "strata_q4_k_m"
            row[key_of] = row[key_of] if row[key_of] is not None else ours
        if row["llamacpp"]:
            bf16 = "ceiling" if budget == "all" else "split"
            if row["strata"] is None and decode_tok_s(cases.get(f"{bf16}/{key}")):  # no llama.cpp bf16 twin: still shown
                row["strata"] = cases[f"{bf16}/{key}"]["metrics"].get(f"{measure}_tok_s")
            out.append(row)
    return out


def _vram(total: float | None, kv: float | None) -> str:
    """A VRAM cell's side: GiB, with the KV cache's share where the run recorded it ("6.6 (1.5)")."""
    if not total:
        return "?"
    return fmt(total, 1, 2**30) + (f" ({fmt(kv, 1, 2**30)})" if kv is not None else "")


def _placement(config: dict) -> str | None:
    """llama.cpp's expert placement as the table shows it: its -ncmoe, and the stacks -ot moved (older runs
    recorded -ncmoe alone)."""
    return config.get("placement") or (str(config["n_cpu_moe"]) if config.get("n_cpu_moe") is not None else None)


def llamacpp_table(doc: dict) -> str:
    """The table "strata against llama.cpp" (empty when no llama.cpp case ran), with a note under it when a Q4_K_M
    ratio had to be taken against strata's bf16 run."""
    rows = llamacpp_rows(doc)
    if not rows:
        return ""
    lines = ["| routing | budget | workload | measure | strata bf16 tok/s | llama.cpp bf16 tok/s | "
             "strata / llama.cpp bf16 | strata Q4_K_M tok/s | llama.cpp Q4_K_M tok/s | strata / llama.cpp Q4_K_M | "
             "llama.cpp --n-cpu-moe (+ -ot): bf16 / Q4_K_M | VRAM GiB (KV cache): strata / llama.cpp bf16 | "
             "VRAM GiB (KV cache): strata / llama.cpp Q4_K_M |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fallback = False
    for r in rows:
        cells, vram = [fmt(r["strata"], 2)], []
        for label in LABELS:
            x = r["llamacpp"].get(label) or {}
            mixed = bool(x) and x["strata_weights"] != label  # strata's bf16 run against llama.cpp's Q4_K_M
            fallback |= mixed and bool(x["ratio"])
            ratio = (f"{x['ratio']:,.2f}x" + ("" if x["same_run"] else ACROSS) + (FALLBACK if mixed else "")
                     if x.get("ratio") else "")
            cells += ([fmt(r["strata_q4_k_m"], 2)] if label == "Q4_K_M" else []) + [fmt(x.get("tok_s"), 2), ratio]
            ours = None if mixed else x.get("strata_vram")  # strata's VRAM on other weights is not shown
            ours_kv = None if mixed else x.get("strata_kv")
            vram.append(f"{_vram(ours, ours_kv)} / {_vram(x.get('vram'), x.get('kv'))}" if x.get("vram") or ours else "")
        placed = [(r["llamacpp"].get(label) or {}).get("placement") or "-" for label in LABELS]
        lines.append(f"| {r['routing']} | {r['budget']} | {r['workload']} | {r['measure']} | {' | '.join(cells)} | "
                     f"{' / '.join(placed)} | {' | '.join(vram)} |")
    if fallback:
        lines += ["", f"Q4_K_M ratios marked `{FALLBACK.strip()}`: no strata case on the Q4_K_M file (`split-q4_k_m`) "
                      "was measured for that row, so they divide strata's bf16 run by llama.cpp's Q4_K_M one: not the "
                      "same weights."]
    return "\n".join(lines)


def llamacpp_section(doc: dict, plot: str | None = None) -> list[str]:
    """The report's lines for "strata against llama.cpp": a heading, how the two engines were set up, the table and
    `plot` (the strata / llama.cpp figure's file name); none when no llama.cpp case ran."""
    versus = llamacpp_table(doc)
    if not versus:
        return []
    lines = ["", "### strata against llama.cpp", "",
             "The same checkpoint, routing and GPU budget: strata's bf16 row runs the checkpoint, llama.cpp's "
             "its bf16 GGUF export; both Q4_K_M rows run one GGUF export with the routed experts in Q4_K_M "
             "(strata's: `split-q4_k_m`), each budget the same fraction of the routed-expert bytes of the "
             "weights run (the Q4_K_M rows: the Q4_K_M file's). llama.cpp holds every layer on the GPU "
             "but the routed experts of its first `--n-cpu-moe` layers: the most whole layers of experts that fit "
             "the budget, then the expert stacks of the next layer that fit what is left (`-ot` keeps its others "
             "in RAM; bench/suite/llamacpp_case.py). Flash attention on, `-t` the physical cores, weights read "
             "into pinned host buffers (`-lm none`), batches of strata's prefill chunk. Decode: "
             "`llama-batched-bench` (all streams' tokens over the decode time); prefill: `llama-bench` (mean of its "
             "repetitions). Ratios above 1: strata faster. VRAM: strata's peak (torch's allocator) against the "
             "CUDA buffers llama.cpp reports (model, KV cache, compute).", "", versus]
    if plot:
        lines += ["", f"![strata / llama.cpp per case]({plot})"]
    return lines

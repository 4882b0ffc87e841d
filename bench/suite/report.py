"""The benchmark report's suite section (docs/benchmarks.md), generated from a result document: every case,
the baselines as ratios from the same run, and the targets next to the measured figures."""

from __future__ import annotations

import re
from pathlib import Path

from bench.suite.cells import ACROSS, by_name, decode_tok_s, fmt, pair
from bench.suite.llamacpp_table import llamacpp_section
from bench.suite.results import case_depth

BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"
REF = "p128x1"  # the workload targets and baselines are judged on


def _runs(doc: dict) -> list[dict]:
    """The runs a merged document was made from; empty for a single run."""
    runs = doc.get("runs") or []
    return runs if len(runs) > 1 else []


def case_table(doc: dict) -> str:
    multi = bool(_runs(doc))
    head = ("| case | decode tok/s | slowest stream | prefill tok/s | TTFT s | GPU hit | MB/token by path | "
            "CPU experts/token | stall ms/token | peak VRAM GiB | peak RSS GiB | roofline tok/s (bound) | fraction |"
            + (" run |" if multi else ""))
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for c in doc["cases"]:
        if c["status"] != "ok" or c["variant"] == "serve":
            continue
        m, r = c["metrics"], c.get("roofline") or {}
        paths = ", ".join(f"{k} {v / 1e6:,.0f}" for k, v in sorted((m.get("bytes_per_token") or {}).items()))
        stall = m.get("stall_s_per_token")
        roof = f"{fmt(r.get('tok_s'))} ({r.get('bound')})" if r.get("tok_s") else ""
        rows.append(f"| {c['name']} | {fmt(m.get('decode_tok_s'), 2)} | {fmt(m.get('slowest_stream_tok_s'), 2)} | "
                    f"{fmt(m.get('prefill_tok_s'), 0)} | {fmt(m.get('ttft_s'), 3)} | {fmt(m.get('gpu_hit_rate'), 3)} | "
                    f"{paths} | {fmt(m.get('cpu_experts_per_token'), 1)} | {fmt(stall, 2, 1e-3) if stall is not None else ''} | "
                    f"{fmt(m.get('peak_vram_bytes'), 1, 2**30)} | {fmt(m.get('peak_rss_bytes'), 1, 2**30)} | {roof} | "
                    f"{fmt(c.get('fraction_of_roofline'), 3)} |" + (f" {c.get('run', '')} |" if multi else ""))
    return "\n".join(rows)


def step_split(c: dict, layers: int) -> dict | None:
    """Where one decode step of a one-graph split case goes, in ms, from its mailbox worker's decode window
    (`mailbox_window`): `cold`, the layers' cold phases (the worker's serve time, during which the GPU reads its
    in-place share); `between`, the GPU's work from one layer's answer to the next layer's post (the combine, the
    next attention, routing, the pack); `rest`, the step's ends (the first layer's attention and routing, the
    LM head, sampling, the launch); `cold_GB_s`, the step's cold bytes over its cold phases; `roofline`, the
    roofline's time a step. None without a window."""
    m = c.get("metrics") or {}
    w, tok = m.get("mailbox_window"), m.get("decode_tok_s")
    if not w or not tok or not w.get("layers") or layers < 1:
        return None
    streams = (c.get("workload") or {}).get("streams") or 1  # a step decodes one token of every stream
    step_s = streams / tok
    cold = layers * w["serve_us"] * 1e-6
    between = (layers - 1) * (w.get("gpu_gap_us") or 0.0) * 1e-6
    roof = c.get("roofline") or {}
    per_step = (roof.get("cold_bytes_per_token") or 0) * streams
    return {"step": step_s * 1e3, "cold": cold * 1e3, "between": between * 1e3, "rest": (step_s - cold - between) * 1e3,
            "cold_GB_s": per_step / cold / 1e9 if per_step and cold else None,
            "roofline": streams / roof["tok_s"] * 1e3 if roof.get("tok_s") else None}


def step_table(doc: dict) -> str:
    """`step_split` for every case that has a mailbox window."""
    multi = bool(_runs(doc))
    rows = ["| case | step ms | cold phases ms | GPU between layers ms | step's ends ms | cold bytes GB/s | "
            "roofline ms | fraction |" + (" run |" if multi else ""),
            "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if multi else "")]
    for c in doc["cases"]:
        name = c["name"]
        # a run on another depth names its cases "...@{layers}L" (results.load); the others take the checkpoints'
        depth = case_depth(name)
        layers = depth or ((doc.get("models") or {}).get(c.get("routing")) or {}).get("layers") or 0
        split = step_split(c, layers) if c.get("status") == "ok" else None
        if split is None:
            continue
        rows.append(f"| {name} | {split['step']:.2f} | {split['cold']:.2f} | {split['between']:.2f} | {split['rest']:.2f} | "
                    f"{fmt(split['cold_GB_s'], 1)} | {fmt(split['roofline'], 2)} | "
                    f"{fmt(c.get('fraction_of_roofline'), 3)} |" + (f" {c.get('run', '')} |" if multi else ""))
    return "\n".join(rows) if len(rows) > 2 else ""


def baseline_table(doc: dict) -> str:
    """strata (split, 25% budget) against every baseline and ablation, per routing, as ratios."""
    multi = bool(_runs(doc))
    rows = ["| routing | against | their decode tok/s | strata split tok/s | strata / them |" + (" run |" if multi else ""),
            "| --- | --- | --- | --- | --- |" + (" --- |" if multi else "")]
    others = [("ceiling/all", "ceiling: all experts in VRAM"), ("hf/b25", "transformers + accelerate offload"),
              ("naive/b25", "naive on-demand (per-layer LRU, no prefetch, no CPU)"),
              ("no-prefetch/b25", "ablation: prefetch off"), ("copy-only/b25", "ablation: CPU compute off"),
              ("cpu-only/b0", "ablation: copies off (CPU only)"), ("static/b25", "static hot set (vs adaptive LFU)"),
              ("disk/b25-ram50", "half the experts only on disk"),
              ("repro/b25", "the same, every request reproducible (`strata_reproducible`)")]
    for routing in ("uniform", "skewed"):
        for prefix, label in others:
            a, b, same = pair(doc, f"split/b25/{routing}/{REF}", f"{prefix}/{routing}/{REF}")
            ours, theirs = decode_tok_s(a), decode_tok_s(b)
            if theirs is None:
                continue
            ratio = f"{ours / theirs:,.2f}x" + ("" if same else ACROSS) if ours and theirs else ""
            run = (f" {a.get('run', '')} |" if same or a is None else f" {a.get('run', '')}, {b.get('run', '')} |") if multi else ""
            rows.append(f"| {routing} | {label} | {fmt(theirs, 2)} | {fmt(ours, 2)} | {ratio} |{run}")
    return "\n".join(rows)


def targets(doc: dict) -> list[dict]:
    """The targets with what this run measured: {target, measured, status}."""
    cases = by_name(doc)
    layers = {r: (doc.get("models", {}).get(r) or {}).get("layers") for r in ("uniform", "skewed")}
    out = []

    def add(target: str, measured: str | None, ok: bool | None, unknown: str = "not measured") -> None:
        status = unknown if ok is None else ("met" if ok else "NOT met")
        out.append({"target": target, "measured": measured or "", "status": status})

    def at_48(target: str, rate: float | None, n: int | None, need: float, digits: int) -> None:
        # n layers' rate x n/48 is a lower bound on the 48-layer model's: the per-token (or per-prompt) part
        # that does not grow with depth (embedding, LM head, sampling, the scheduler) is counted 48/n times
        # over. So a bound that meets the target meets it; one that does not says nothing either way.
        scaled = rate * n / 48 if rate and n else None
        measured = f"{rate:,.{digits}f} tok/s on {n} layers: >= {scaled:,.{digits}f} at 48" if scaled else None
        add(target, measured, True if scaled is not None and scaled >= need else None,
            "not measured" if scaled is None else "not measured at 48 layers (the bound from 12 is below)")

    for routing in ("uniform", "skewed"):
        # the reference depth's case, then any deeper checkpoint's (the 24-layer cut of the bench model, where the
        # whole one does not fit the machine's RAM): every depth measured is listed, and the target is met only if all
        # meet it
        found = []
        for name in [f"split/b25/{routing}/{REF}"] + sorted(
                (n for n in cases if n.startswith(f"split/b25/{routing}/{REF}@")), key=case_depth):
            c = cases.get(name)
            if c and c["status"] == "ok" and c.get("fraction_of_roofline") is not None:
                found.append((c["fraction_of_roofline"], case_depth(name) or layers.get(routing)))
        measured = "; ".join(fmt(f, 3) + (f" on {n} layers" if n and len(found) > 1 else "") for f, n in found)
        add(f"25% GPU budget, {routing}: >= 80% of the roofline", measured or None,
            all(f >= 0.8 for f, _ in found) if found else None)
    def ratio(routing: str, other: str) -> tuple[float | None, str]:
        a, b, same = pair(doc, f"split/b25/{routing}/{REF}", f"{other}/{routing}/{REF}")
        ours, theirs = decode_tok_s(a), decode_tok_s(b)
        return (ours / theirs if ours and theirs else None), ("" if same else ACROSS)

    for routing in ("uniform", "skewed"):
        for prefix, need, label in (("hf/b25", 100, "transformers + accelerate"), ("naive/b25", 2, "naive on-demand")):
            r, note = ratio(routing, prefix)
            add(f"25%, {routing}: >= {need}x {label}", f"{r:,.1f}x{note}" if r else None, None if r is None else r >= need)
    for routing in ("uniform", "skewed"):
        for v in ("copy-only/b25", "cpu-only/b0"):
            r, note = ratio(routing, v)
            add(f"25%, {routing}: the split beats {v.split('/')[0]}", f"{r:,.2f}x{note}" if r else None,
                None if r is None else r > 1)
    c = cases.get(f"split/b40/skewed/{REF}")
    hit = c["metrics"].get("gpu_hit_rate") if c and c["status"] == "ok" else None
    add("skewed, 40% of experts fit, adaptive policy: GPU hit rate >= 90%", fmt(hit, 3) if hit is not None else None,
        None if hit is None else hit >= 0.9)
    for routing in ("uniform", "skewed"):
        target = f"all in VRAM ({routing}), 1 stream: >= 250 tok/s (48 layers)"
        full = decode_tok_s(cases.get(f"ceiling/all/{routing}/{REF}@48L"))  # a run on the full-depth model
        if full is not None:
            add(target, f"{full:,.1f} tok/s on 48 layers", full >= 250)
            continue
        tok, n = decode_tok_s(cases.get(f"ceiling/all/{routing}/{REF}")), layers.get(routing)
        if tok is not None or routing == "uniform":
            at_48(target, tok, n, 250, 1)
    for routing in ("uniform", "skewed"):
        c = cases.get(f"split/b25/{routing}/p8192x1")
        p, n = (c["metrics"].get("prefill_tok_s") if c and c["status"] == "ok" else None), layers.get(routing)
        if p is not None or routing == "uniform":
            at_48(f"8K prompt, 25% ({routing}): prefill >= 3,000 tok/s (48 layers)", p, n, 3000, 0)
    serve = next((c for c in doc["cases"] if c["variant"] == "serve" and c["status"] == "ok"), None)
    ready = serve["metrics"]["ready_s"] if serve else None
    m = serve["metrics"] if serve else {}
    after = (f" (then its first request {m['first_request_s']:.2f} s, its first 4 at once {m['first_batch4_s']:.2f} s; "
             f"again {m['again_request_s']:.2f} s and {m['again_batch4_s']:.2f} s)") if "again_batch4_s" in m else ""
    add("`strata serve` ready (store built) <= 30 s", f"{ready:.1f} s{after}" if ready is not None else None,
        None if ready is None else ready <= 30)
    return out


def _repeated(doc: dict) -> bool:
    """Whether any case of `doc` was timed more than once (`bench run --repeats`)."""
    return any(len((c.get("metrics") or {}).get("decode_tok_s_runs") or ()) > 1 for c in doc.get("cases", []))


def render(doc: dict, command: str | None = None, plot: str | None = None, llamacpp_plot: str | None = None) -> str:
    """The markdown section (without markers); `llamacpp_plot`: the strata / llama.cpp figure's file name."""
    m, rates = doc["machine"], doc["rates"]
    runs = _runs(doc)
    when = f"{len(runs)} runs, {runs[0]['started']} to {runs[-1]['started']}" if runs else doc.get("started", "")
    lines = [f"## Benchmark suite — {when}", ""]
    if runs:
        lines += ["Merged from these runs (a case measured in several comes from the latest; a ratio comes from the "
                  "latest run that measured both sides, else it says `across runs`):", ""]
        lines += [f"- run {r['label']}: {r['started']}, code {r['commit']}, `{r['source']}`"
                  + (f" ({r['layers']}-layer checkpoints: its cases are marked @{r['layers']}L)" if r.get("layers") else "")
                  for r in runs]
        lines.append("")
    if command:
        raw = "the runs' files above" if runs else "`suite.json`"
        lines += [f"Command: `{command}` (raw JSON: {raw}; this section is generated by `python -m bench report`).", ""]
    gpu = f"{m.get('gpu')} ({fmt(m.get('gpu_memory_bytes'), 0, 2**20)} MiB, driver {m.get('driver')})" if m.get("gpu") else "no GPU"
    lines += [f"Machine: {gpu}; {m.get('cpu')} ({m.get('cpu_cores')} cores), {fmt(m.get('ram_bytes'), 0, 2**30)} GiB RAM; "
              f"torch {m.get('torch')}, transformers {m.get('transformers')}, accelerate {m.get('accelerate')}, "
              f"strata {m.get('strata')} at {str(m.get('git_commit'))[:10]}{' (dirty tree)' if m.get('git_dirty') else ''}.", ""]
    src = rates.get("source", {})
    lines += ["Roofline rates: " + ", ".join(
        f"{k} {rates[k] / 1e9:,.1f} GB/s ({_source(src.get(k))})" for k in ("pcie", "cpu", "hbm", "disk")) +
        (f"; host RAM read {rates['extra']['ram_read_GBps']} GB/s (measured, not used)" if rates.get("extra", {}).get("ram_read_GBps") else "") + ".", ""]
    for depth, models in [(None, doc.get("models", {})), *sorted((doc.get("models_at") or {}).items())]:
        for routing, info in models.items():
            pop = info.get("popularity") or {}
            popularity = (f"; measured: the 10% / 25% / 40% most used experts of a layer take {pop.get('top10pct_share')} / "
                          f"{pop.get('top25pct_share')} / {pop.get('top40pct_share')} of its lookups") if pop else ""
            if pop.get("consecutive_overlap") is not None:
                popularity += (f"; consecutive tokens share {pop['consecutive_overlap']} of their experts "
                               f"({pop['independent_overlap']} if drawn independently at that popularity)")
            which = f" (the @{depth}L cases)" if depth else ""
            lines.append(f"- {routing} checkpoint{which}: {info.get('layers')} layers x {info.get('experts_per_layer')} "
                         f"experts (top-{info.get('experts_per_token')}), {fmt(info.get('expert_bytes_total'), 1, 1e9)} GB "
                         f"of experts, `--route-skew {info.get('route_skew', '?')}`"
                         + (f" `--route-locality {info['route_locality']}`" if info.get("route_locality") else "")
                         + f"{popularity}.")
    lines += ["", "Decode figures are over the decode phase (after every stream has its first token); prompts are "
              "random token ids, sampling at temperature 1 with fixed seeds and `ignore_eos` (so every stream "
              "generates all its tokens); strata runs through its continuous-batching scheduler"
              + (", each case's workload timed several times on its engine (`--repeats`), the run with the median "
                 "decode rate reported" if _repeated(doc) else "")
              + ". GPU budgets are fractions of the expert bytes; the rest sits in pinned RAM (the disk case: half in "
              "RAM).", ""]
    lines += ["### Targets", "", "| target | measured | status |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {t['status']} |" for t in targets(doc)]
    lines += ["", "### Against the baselines (25% GPU budget, 128-token prompt, 1 stream)", "", baseline_table(doc)]
    lines += llamacpp_section(doc, llamacpp_plot)
    lines += ["", "### Every case", "", case_table(doc)]
    steps = step_table(doc)
    if steps:
        lines += ["", "### Where a split decode step goes (one-graph steps, from the CPU worker's decode window)", "",
                  "The cold phases are the layers' CPU worker trips, during which the GPU reads its in-place share of the "
                  "cold experts; between two of them the GPU runs the combine, the next attention and routing, and the "
                  "next post; the step's ends are the first layer's attention and routing, the LM head, sampling and "
                  "the launch. The roofline counts the cold bytes alone, so the GPU's work between layers and at the "
                  "step's ends is what separates a split step from it.", "", steps]
    notes = [c for c in doc["cases"] if c["status"] != "ok" or c.get("note")]
    if notes:
        lines += ["", "### Skipped, failed or cut short", ""]
        lines += [f"- `{c['name']}`: {c['status']}: {c.get('reason') or c.get('note')}" for c in notes]
    if plot:
        lines += ["", f"![tok/s and GPU hit rate against the GPU expert budget]({plot})"]
    return "\n".join(lines) + "\n"


def _source(source: str | None) -> str:
    """Where a roofline rate came from: "measured" in the run, else the machine's reference figure
    (`roofline.LIMITS`, whatever label the run recorded it under)."""
    return "measured" if source == "measured" else "reference" if source else "?"


def update_report(path: str | Path, section: str) -> None:
    """Replace the text between the suite markers of the report at `path` (append the markers when absent)."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{BEGIN}\n{section.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, count=1, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


_RUN_LINE = re.compile(r"^- run [A-Z]+: [^`\n]*`([^`\n]+)`", re.M)
_COMMAND_LINE = re.compile(r"^Command: `(.*)` \(raw JSON", re.M)


def section_sources(path: str | Path) -> tuple[list[str], str | None]:
    """The run files (in order) and the quoted command that the suite section of the report `path` was generated
    from: what `python -m bench report --append NEW.json` merges the new runs after. ([], None) without a section;
    a section made from a single run lists no file (its run is not named), which the caller must refuse."""
    text = Path(path).read_text() if Path(path).exists() else ""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return [], None
    section = text[start:end]
    command = _COMMAND_LINE.search(section)
    return _RUN_LINE.findall(section), command.group(1) if command else None

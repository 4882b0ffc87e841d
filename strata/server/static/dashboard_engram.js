// strata dashboard, Engram panel: row hit ratio per serving tier over time, bytes read, stall.
// Reads `engram` of /v1/strata/stats (Engine.stats()["engram"]); shown only when the model has Engram layers. Its
// charts draw the samples' `engram` ({tier, hits: {tier: rows}, bytes, stall}), which the server's history holds
// and record() adds to the page's own samples. Registers itself in window.strataDashboardPlugins; dashboard.js
// calls record() per sample it takes itself and render() per draw.
"use strict";

(function () {
  const TIERS = ["cache", "gpu", "pinned", "tmpfs", "disk"];  // the row cache first, then the table tiers
  const LIVE_S = 5;  // the window of the live rates next to the totals

  // one row store's figures, or the sum over cards when a multi-GPU engine reports {"devices": {...}}
  function flatten(e) {
    if (!e || typeof e !== "object" || !e.devices || typeof e.devices !== "object") return e;
    const out = { tier: e.tier, hits: {} };
    for (const d of Object.values(e.devices)) {
      if (!d || typeof d !== "object") continue;
      if (out.tier === undefined) out.tier = d.tier;
      for (const key of ["lookups", "unique_rows", "bytes_read", "stall_s", "prefetched_rows", "cache_rows",
                         "cache_resident", "cache_evictions", "table_bytes"]) {
        if (typeof d[key] === "number") out[key] = (out[key] || 0) + d[key];
      }
      for (const [t, n] of Object.entries(d.hits || {})) if (typeof n === "number") out.hits[t] = (out.hits[t] || 0) + n;
    }
    return out;
  }

  // the panel's cumulative counters (the history's `engram`)
  function record(stats, sample, lib) {
    const e = flatten(lib.get(stats, "engram", null));
    if (!e || typeof e !== "object") { sample.engram = null; return; }
    const hits = {};
    for (const [t, n] of Object.entries(e.hits || {})) hits[t] = lib.num(n) || 0;
    sample.engram = { tier: String(e.tier || ""), hits, bytes: lib.num(e.bytes_read), stall: lib.num(e.stall_s) };
  }

  const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
  const rowsOf = (x, tier) => (x.engram && x.engram.hits ? num(x.engram.hits[tier]) || 0 : null);
  const servedOf = (x) => (x.engram && x.engram.hits  // distinct rows served, all tiers
    ? Object.values(x.engram.hits).reduce((a, b) => a + (num(b) || 0), 0) : null);
  const engramOf = (key) => (x) => (x.engram ? num(x.engram[key]) : null);

  function render(state, lib) {
    const panel = lib.$("engram-panel");
    if (!panel) return;
    const e = flatten(lib.get(state.stats || {}, "engram", null));
    const on = !!e && typeof e === "object";
    panel.hidden = !on;
    document.body.dataset.engram = on ? String(e.tier || "") : "";
    if (!on) return;
    const memory = e.tier === "memory";
    lib.setText("engram-tier", "· tables: " + String(e.tier || "—"));
    lib.setText("engram-hint", memory
      ? "Engram tables are held in memory (runtime.experts = \"memory\"): rows are not counted."
      : "share of distinct table rows served by the row cache and the table tier (legend: since start)");

    const hits = {};
    for (const [t, n] of Object.entries(e.hits || {})) hits[t] = lib.num(n) || 0;
    const served = Object.values(hits).reduce((a, b) => a + b, 0);
    const cacheRows = lib.num(e.cache_rows) || 0;
    for (const t of TIERS) {
      const present = !memory && (t in hits || t === e.tier || (t === "cache" && cacheRows > 0));
      const v = present ? (served ? (hits[t] || 0) / served : 0) : null;
      lib.setText("engram-hit-" + t, present ? lib.fmtPct(v) : "—", v);
      const li = document.querySelector(`#engram-legend li[data-tier="${t}"]`);
      if (li) li.classList.toggle("absent", !present);
    }

    const samples = state.samples;
    const lookups = lib.num(e.lookups), bytes = lib.num(e.bytes_read), stall = lib.num(e.stall_s);
    lib.setText("engram-lookups", lib.fmtNum(lookups), lookups);
    const readRate = lib.rateSeries(samples, engramOf("bytes"), LIVE_S).pop();
    lib.setText("engram-bytes", lib.fmtBytes(bytes) + (readRate && readRate[1] !== null ? " · " + lib.fmtRate(readRate[1]) : ""),
      bytes);
    const stallShare = lib.rateSeries(samples, engramOf("stall"), LIVE_S).pop();
    lib.setText("engram-stall", lib.fmtSeconds(stall) + (stallShare && stallShare[1] !== null
      ? " · " + lib.fmtPct(stallShare[1]) + " live" : ""), stall);
    const resident = lib.num(e.cache_resident);
    lib.setText("engram-cache", cacheRows ? `${lib.fmtNum(resident)} / ${lib.fmtNum(cacheRows)} rows` : "none", resident);
    const evictions = lib.num(e.cache_evictions);
    lib.setText("engram-evictions", lib.fmtNum(evictions), evictions);
    const tableBytes = lib.num(e.table_bytes);
    lib.setText("engram-table-bytes", lib.fmtBytes(tableBytes), tableBytes);

    const now = samples.length ? samples[samples.length - 1].t : 0;
    const win = Number(lib.$("engram-window").value), span = lib.span();
    lib.setText("engram-scope", lib.windowLabel(win));
    const shown = memory ? [] : TIERS.filter((t) => samples.some((x) => x.engram && (t in (x.engram.hits || {}) || t === x.engram.tier)));
    lib.drawLineChart(lib.$("engram-chart"), shown.map((t) => ({ color: lib.css("--" + t),
      points: lib.shareSeries(samples, (x) => rowsOf(x, t), servedOf, win) })),
    { now, span, yMax: 1, yStep: 0.25, format: lib.pct });
    lib.drawLineChart(lib.$("engram-io-chart"), memory ? [] : [
      { color: lib.css("--read"), points: lib.rateSeries(samples, engramOf("bytes"), 1) },
    ], { now, span, format: (v) => lib.fmtShort(v) + "B/s" });
  }

  (window.strataDashboardPlugins = window.strataDashboardPlugins || []).push({ name: "engram", record, render });
  const select = document.getElementById("engram-window");  // deferred script: the page is parsed
  if (select) {
    select.addEventListener("change", () => {
      const s = window.strataDashboard;
      if (s && s.lib) render(s, s.lib);
    });
  }
})();

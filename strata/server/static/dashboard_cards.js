// strata dashboard, per-card panel: a model split over several GPUs (stages) has one tier manager per card.
// Reads `tiers.devices` of /v1/strata/stats ({"cuda:N": {stage_layers, gpu_hit_rate, lookups, pcie_bytes,
// tiers: {gpu: {resident, capacity, hits}}}}) and `tiers.stage_hops` ({hops, bytes, seconds, timed}); shown only
// when `tiers.devices` exists. Its chart draws the samples' `cards` ({device: {lookups, gpu_hits, pcie}}), which
// the server's history holds and record() adds to the page's own samples. Registers itself in
// window.strataDashboardPlugins (see dashboard_engram.js).
"use strict";

(function () {
  const WINDOW_S = 10;  // the window of the GPU hit ratio chart
  const LIVE_S = 5;     // the window of the live rates next to the totals
  const PALETTE = ["#34d399", "#60a5fa", "#fbbf24", "#f472b6", "#c084fc", "#22d3ee", "#fb923c", "#a3e635"];

  function cardsOf(stats, lib) {
    const per = lib.get(stats || {}, "tiers.devices", null);
    return per && typeof per === "object" && !Array.isArray(per) && Object.keys(per).length ? per : null;
  }

  // each card's cumulative counters, for live rates and the windowed hit ratio (the history's `cards`)
  function record(stats, sample, lib) {
    const per = cardsOf(stats, lib);
    const hops = lib.get(stats, "tiers.stage_hops", null);
    sample.hop_bytes = hops && typeof hops === "object" ? lib.num(hops.bytes) : null;
    if (!per) { sample.cards = null; return; }
    sample.cards = {};
    for (const [dev, d] of Object.entries(per)) {
      if (!d || typeof d !== "object") continue;
      sample.cards[dev] = {
        lookups: lib.num(d.lookups),
        gpu_hits: lib.num(lib.get(d, "tiers.gpu.hits", null)),
        pcie: lib.num(d.pcie_bytes),
      };
    }
  }

  const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
  const pick = (dev, key) => (x) => (x.cards && x.cards[dev] ? num(x.cards[dev][key]) : null);

  function layersText(stageLayers) {
    if (!Array.isArray(stageLayers) || stageLayers.length !== 2) return "—";
    const [a, b] = stageLayers;  // [first, end)
    return b - a > 1 ? `${a}–${b - 1}` : String(a);
  }

  function cell(lib, key, text, value) {
    const td = lib.el("td", { text, "data-key": key });
    if (lib.num(value) !== null) td.dataset.value = String(value);
    return td;
  }

  function render(state, lib) {
    const panel = lib.$("cards-panel");
    if (!panel) return;
    const per = cardsOf(state.stats, lib);
    panel.hidden = !per;
    document.body.dataset.cards = per ? String(Object.keys(per).length) : "0";
    if (!per) return;
    const samples = state.samples, devs = Object.keys(per);
    const body = lib.$("card-table").tBodies[0];
    body.replaceChildren(...devs.map((dev, i) => {
      const d = per[dev] || {};
      const hit = lib.num(d.gpu_hit_rate), lookups = lib.num(d.lookups), pcie = lib.num(d.pcie_bytes);
      const live = lib.rateSeries(samples, pick(dev, "pcie"), LIVE_S).pop();
      const gpu = lib.get(d, "tiers.gpu", null);
      const res = gpu ? lib.num(gpu.resident) : null, cap = gpu ? lib.num(gpu.capacity) : null;
      const sw = lib.el("i", { class: "sw" });
      sw.style.background = PALETTE[i % PALETTE.length];
      const name = lib.el("td", { "data-key": "card" }, [sw, document.createTextNode(" " + dev)]);
      return lib.el("tr", { "data-card": dev }, [
        name,
        cell(lib, "layers", layersText(d.stage_layers)),
        cell(lib, "gpu-hit", lib.fmtPct(hit), hit),
        cell(lib, "lookups", lib.fmtNum(lookups), lookups),
        cell(lib, "pcie", lib.fmtBytes(pcie) + (live && live[1] !== null ? " · " + lib.fmtRate(live[1]) : ""), pcie),
        cell(lib, "gpu-resident", gpu ? `${lib.fmtNum(res)} / ${lib.fmtNum(cap)}` : "no gpu tier", res),
      ]);
    }));

    const hops = lib.get(state.stats, "tiers.stage_hops", null) || {};
    const count = lib.num(hops.hops), bytes = lib.num(hops.bytes), secs = lib.num(hops.seconds);
    lib.setText("stage-hops", lib.fmtNum(count), count);
    const hopRate = lib.rateSeries(samples, (x) => lib.num(x.hop_bytes), LIVE_S).pop();
    lib.setText("stage-hop-bytes", lib.fmtBytes(bytes) + (hopRate && hopRate[1] !== null ? " · " + lib.fmtRate(hopRate[1]) : ""),
      bytes);
    const timed = lib.num(hops.timed);
    lib.setText("stage-hop-time", timed ? `${lib.fmtSeconds(secs)} (${lib.fmtNum(timed)} timed)` : "not timed", secs);

    const now = samples.length ? samples[samples.length - 1].t : 0;
    lib.drawLineChart(lib.$("cards-chart"), devs.map((dev, i) => ({ color: PALETTE[i % PALETTE.length],
      points: lib.shareSeries(samples, pick(dev, "gpu_hits"), pick(dev, "lookups"), WINDOW_S) })),
    { now, span: lib.span(), yMax: 1, yStep: 0.25, format: lib.pct });
  }

  (window.strataDashboardPlugins = window.strataDashboardPlugins || []).push({ name: "cards", record, render });
})();

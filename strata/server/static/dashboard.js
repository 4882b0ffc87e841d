// strata tier dashboard: reads the server's history of the charts' figures (/v1/strata/history) on opening, then
// polls /v1/strata/stats, /v1/strata/residency and the history's new samples, and draws them on <canvas>. With a
// server API key, every poll carries it and a 401 waits for one (dashboard_auth.js).
// Plain JavaScript, no dependencies, nothing loaded from anywhere but this server; dashboard_draw.js draws.
"use strict";

(function () {
  const D = window.strataDraw;
  const { css, num, fmtNum, fmtPct, fmtBytes, fmtRate, fmtSeconds, fmtShort, rateSeries, shareSeries } = D;
  const TIERS = ["gpu", "pinned", "tmpfs", "disk"];
  const KEEP_S = 3660;        // seconds of samples kept (the history's longest span, and a step)
  const MAX_SAMPLES = 4000;   // and at most this many (a fast ?interval= without a server history)
  const LIVE_S = 5;           // the window of the "last 5 s" figures
  const GRID_KEEP_S = 15;     // residency grids kept for the "last 10 s" traffic view (dashboard_experts.js)
  const params = new URLSearchParams(location.search);
  const INTERVAL_MS = Math.max(200, Number(params.get("interval")) || 1000);

  const $ = (id) => document.getElementById(id);

  // ---- state -----------------------------------------------------------------------------------
  // A sample is what the charts need of one stats snapshot (figuresOf) at time t; every number in it but t,
  // running and waiting is a cumulative counter. With a server history ("server"), the samples are the server's
  // (t on its monotonic clock, a sample a second); without one ("page"), the page samples its own polls.
  const state = {
    samples: [],
    source: null,     // "server" | "page"
    grids: [],        // recent residency grids [{t, grid}] (newest last)
    stats: null,
    grid: null,
    polls: 0,
    gridPolls: 0,
    historyPolls: 0,
    errors: 0,
  };
  window.strataDashboard = state;  // for debugging and tests

  function get(obj, path, fallback) {
    let cur = obj;
    for (const key of path.split(".")) {
      if (cur === null || cur === undefined || typeof cur !== "object" || !(key in cur)) return fallback;
      cur = cur[key];
    }
    return cur === null || cur === undefined ? fallback : cur;
  }
  function setText(id, text, value) {
    const el = $(id);
    if (!el) return;
    if (el.textContent !== text) el.textContent = text;
    if (value === undefined || value === null || (typeof value === "number" && !isFinite(value))) delete el.dataset.value;
    else el.dataset.value = String(value);
  }
  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v;
      else if (k === "class") e.className = v;
      else e.setAttribute(k, v);
    }
    for (const c of children || []) e.appendChild(c);
    return e;
  }
  const span = () => Number($("span").value) || 180;
  const windowLabel = (w) => (Number(w) ? `last ${w} s` : "since start");

  // ---- colours ---------------------------------------------------------------------------------
  function pathColor(path, i) {
    const to = path.split("->")[1];
    const from = path.split("->")[0];
    const palette = ["#fbbf24", "#f472b6", "#22d3ee", "#a3e635", "#fb923c", "#e879f9"];
    if (from === "disk" && to === "pinned") return css("--pinned");
    if (from === "tmpfs" && to === "pinned") return css("--tmpfs");
    if (to === "gpu") return from === "disk" ? "#fbbf24" : css("--gpu");
    return palette[i % palette.length];
  }

  // ---- rendering -------------------------------------------------------------------------------
  const lastRate = (pick, windowS) => {
    const r = rateSeries(state.samples, pick, windowS).pop();
    return r ? r[1] : null;
  };

  function renderStats() {
    const s = state.stats || {};
    const tiers = get(s, "tiers", null);
    const model = get(s, "model", "");
    setText("model", model ? String(model).split("/").filter(Boolean).pop() || String(model) : "—");
    $("model").title = String(model || "");
    setText("model-type", String(get(s, "model_type", "—")));
    const device = get(s, "device", null), dtype = get(s, "dtype", null);
    setText("device", device ? device + (dtype ? " · " + dtype : "") : "—");
    setText("experts-mode", String(get(s, "experts", "—")));
    setText("uptime", fmtSeconds(num(get(s, "tiers.uptime_s", null))));

    const tok = num(get(s, "decode_tokens_per_s", null));
    setText("tok-s", fmtNum(tok, 1), tok);
    const prefill = num(get(s, "prefill_tokens_per_s", null));
    setText("prefill-tok-s", fmtNum(prefill, 1), prefill);
    const live = lastRate((x) => x.gen, LIVE_S);
    setText("throughput", live !== null ? fmtNum(live, 1) : "—", live);
    const running = num(get(s, "scheduler.running", null)), waiting = num(get(s, "scheduler.waiting", null));
    setText("running", fmtNum(running), running);
    setText("waiting", fmtNum(waiting), waiting);
    for (const [id, key] of [["requests", "requests"], ["prompt-tokens", "prompt_tokens"], ["gen-tokens", "generated_tokens"]]) {
      const v = num(get(s, key, null));
      setText(id, fmtNum(v), v);
    }
    const prefixHit = num(get(s, "scheduler.prefix_cache.hit_ratio", null));  // prompt tokens served from the cache
    setText("prefix-hit", get(s, "scheduler.prefix_cache.enabled", true) === false ? "off" : fmtPct(prefixHit), prefixHit);
    const lookups = num(get(s, "tiers.lookups", null)), misses = num(get(s, "tiers.misses", null));
    setText("lookups", fmtNum(lookups), lookups);
    setText("misses", lookups && misses !== null ? `${fmtNum(misses)} (${fmtPct(misses / lookups)})` : fmtNum(misses), misses);
    const stall = num(get(s, "tiers.stall_seconds", null));
    setText("stall", fmtSeconds(stall), stall);
    const precision = num(get(s, "tiers.prefetch.precision", null)), recall = num(get(s, "tiers.prefetch.recall", null));
    const issued = num(get(s, "tiers.prefetch.issued", null));
    setText("prefetch-precision", issued ? fmtPct(precision) : issued === 0 ? "off" : "—", precision);
    setText("prefetch-recall", issued ? fmtPct(recall) : "—", recall);
    const late = num(get(s, "tiers.prefetch.late", null));
    setText("prefetch-late", fmtNum(late), late);

    // hit ratios in the legend: since start, as the server computes them
    const hitRate = get(s, "tiers.hit_rate", {});
    const tierNames = Object.keys(get(s, "tiers.tiers", {}));
    for (const t of TIERS) {
      const present = tierNames.includes(t) || t in hitRate;
      const v = present ? num(hitRate[t]) ?? 0 : null;
      setText("hit-" + t, present ? fmtPct(v) : "—", v);
      const li = document.querySelector(`#hit-legend li[data-tier="${t}"]`);
      if (li) li.classList.toggle("absent", !present);
    }

    renderTierTable(get(s, "tiers.tiers", {}));
    renderPaths(get(s, "tiers.paths", {}));
    const damaged = get(s, "tiers.damaged", []);
    const failures = num(get(s, "tiers.checksum_failures", 0)) || 0;
    setText("damaged", failures ? `${failures} checksum failure(s); damaged: ${damaged.map((k) => "L" + k[0] + "/E" + k[1]).join(", ")}` : "");
    $("damaged").classList.toggle("bad", failures > 0);

    const notice = $("notice");
    if (state.stats && tiers === null) {
      notice.textContent = "Experts are held in memory (runtime.experts = \"memory\"): there are no tiers to show.";
      notice.hidden = false;
    } else if (state.stats) {
      notice.hidden = true;
    }
  }

  function renderTierTable(tiers) {
    const body = $("tier-table").tBodies[0];
    const names = [...TIERS.filter((t) => t in tiers), ...Object.keys(tiers).filter((t) => !TIERS.includes(t))];
    body.replaceChildren(...names.map((t) => {
      const x = tiers[t] || {};
      const res = num(x.resident) || 0, cap = num(x.capacity) || 0;
      const bar = el("div", { class: "bar" }, [el("i", { class: t })]);
      bar.firstChild.style.width = (cap ? Math.min(100, (100 * res) / cap) : 0).toFixed(1) + "%";
      return el("tr", { "data-tier": t }, [
        el("td", { text: t }),
        el("td", { text: `${fmtNum(res)} / ${fmtNum(cap)}` }),
        el("td", {}, [bar]),
        el("td", { text: fmtNum(num(x.hits)) }),
        el("td", { text: fmtNum(num(x.evictions)) }),
      ]);
    }));
  }

  function renderPaths(paths) {
    const body = $("paths").tBodies[0];
    const names = Object.keys(paths).sort();
    if (!names.length) {
      body.replaceChildren(el("tr", {}, [el("td", { colspan: "5", class: "dim", text: "no transfers yet" })]));
      return;
    }
    body.replaceChildren(...names.map((p, i) => {
      const x = paths[p] || {};
      const sw = el("i", { class: "sw" });
      sw.style.background = pathColor(p, i);
      const name = el("td", {}, [sw]);
      name.appendChild(document.createTextNode(" " + p));
      const gbps = num(x.GB_per_s);
      return el("tr", { "data-path": p, "data-gbps": gbps === null ? "" : String(gbps) }, [
        name,
        el("td", { text: fmtBytes(num(x.bytes)) }),
        el("td", { text: fmtNum(num(x.objects)) }),
        el("td", { text: fmtRate(lastRate((s) => (s.paths && p in s.paths ? s.paths[p] : null), LIVE_S)) }),
        el("td", { text: gbps === null ? "—" : gbps.toFixed(3) + " GB/s" }),
      ]);
    }));
  }

  const pct = (v) => Math.round(v * 100) + "%";

  function renderCharts() {
    const samples = state.samples;
    const now = samples.length ? samples[samples.length - 1].t : 0, shown = span();
    const hitWindow = Number($("hit-window").value);
    setText("hit-scope", windowLabel(hitWindow));
    const present = TIERS.filter((t) => samples.some((x) => (x.hits && t in x.hits) || (x.tiers || []).includes(t)));
    D.drawLineChart($("hit-chart"), present.map((t) => ({
      color: css("--" + t),
      points: shareSeries(samples, (x) => (x.hits ? x.hits[t] || 0 : null), (x) => num(x.lookups), hitWindow),
    })), { now, span: shown, yMax: 1, yStep: 0.25, format: pct });
    D.drawLineChart($("tok-chart"), [
      { color: css("--tok"), points: rateSeries(samples, (x) => x.gen, 1) },
      { color: css("--prompt"), points: rateSeries(samples, (x) => x.prompt, 1) },
    ], { now, span: shown });
    D.drawLineChart($("req-chart"), [
      { color: css("--running"), points: samples.map((x) => [x.t, num(x.running)]) },
      { color: css("--waiting"), points: samples.map((x) => [x.t, num(x.waiting)]) },
    ], { now, span: shown, integer: true });
    const paths = [...new Set(samples.flatMap((x) => Object.keys(x.paths || {})))].sort();
    D.drawLineChart($("bw-chart"), paths.map((p, i) => ({
      color: pathColor(p, i), points: rateSeries(samples, (x) => (x.paths && p in x.paths ? x.paths[p] : null), 1),
    })), { now, span: shown, format: (v) => fmtShort(v) + "B/s" });
  }

  // stacked bars: one per MoE layer, height = lookups since start, split by the tier that answered
  function drawLayerChart() {
    const canvas = $("layer-chart");
    const layers = get(state.stats || {}, "tiers.layers", {});
    const ids = Object.keys(layers).map(Number).filter((x) => isFinite(x)).sort((a, b) => a - b);
    const { ctx, w, h } = D.fitCanvas(canvas);
    const pad = { l: 48, r: 10, t: 8, b: 20 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    let max = 0, worst = null;
    for (const id of ids) {
      const x = layers[id] || {};
      max = Math.max(max, num(x.lookups) || 0);
      const rate = x.lookups ? (num(x.misses) || 0) / x.lookups : 0;
      if (x.lookups && (!worst || rate > worst.rate)) worst = { id, rate, stall: num(x.stall_seconds) || 0 };
    }
    const { step, top } = D.niceScale(max, true);
    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = D.GRID;
    ctx.fillStyle = D.LABEL;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let v = 0; v <= top + 1e-9; v += step) {
      const yy = Math.round(pad.t + ph * (1 - v / top)) + 0.5;
      ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
      ctx.fillText(fmtShort(v), pad.l - 6, yy);
    }
    const bw = ids.length ? pw / ids.length : pw;
    const gap = bw >= 4 ? Math.max(1, Math.floor(bw * 0.15)) : 0;
    const order = [...TIERS];
    const colors = new Set();
    let bars = 0;
    ids.forEach((id, i) => {
      const hits = (layers[id] || {}).hits || {};
      let y0 = pad.t + ph;
      for (const t of [...order, ...Object.keys(hits).filter((k) => !order.includes(k))]) {
        const n = num(hits[t]) || 0;
        if (!n) continue;
        const hh = (ph * n) / top;
        ctx.fillStyle = TIERS.includes(t) ? css("--" + t) : "#888";
        colors.add(ctx.fillStyle);
        ctx.fillRect(pad.l + i * bw + gap / 2, y0 - hh, Math.max(1, bw - gap), hh);
        y0 -= hh;
      }
      if ((layers[id] || {}).lookups) bars++;
    });
    ctx.fillStyle = D.LABEL;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.max(1, Math.ceil(24 / Math.max(1, bw)));
    ids.forEach((id, i) => { if (i % every === 0) ctx.fillText("L" + id, pad.l + (i + 0.5) * bw, pad.t + ph + 4); });
    canvas.dataset.bars = String(bars);
    canvas.dataset.colors = JSON.stringify([...colors]);
    canvas.dataset.plot = JSON.stringify([pad.l, pad.t, pw, ph]);
    setText("worst-layer", worst ? `most misses: layer ${worst.id} (${fmtPct(worst.rate)}, stalled ${fmtSeconds(worst.stall)})` : "");
  }

  // panels in other scripts (dashboard_experts.js, dashboard_engram.js, dashboard_cards.js) register in
  // window.strataDashboardPlugins:
  // {record(stats, sample, lib): add the panel's counters to a sample, as the server's history does;
  //  render(state, lib): draw}. Read on every poll.
  const plugins = () => (Array.isArray(window.strataDashboardPlugins) ? window.strataDashboardPlugins : []);
  state.lib = { ...D, $, get, setText, el, span, windowLabel, pct };

  function renderAll() {
    renderStats();
    drawLayerChart();
    renderCharts();
    for (const p of plugins()) {
      try { if (p.render) p.render(state, state.lib); } catch (e) { console.error("strata dashboard: panel failed", e); }
    }
  }

  // ---- samples ---------------------------------------------------------------------------------
  // What the charts need of one stats snapshot: the shape of the server's history samples
  // (strata/server/dashboard_history.py, figures_of), so that both draw the same.
  function figuresOf(stats) {
    const hits = {};
    for (const [tier, x] of Object.entries(get(stats, "tiers.tiers", {}))) hits[tier] = num(x && x.hits) || 0;
    const paths = {};
    for (const [p, x] of Object.entries(get(stats, "tiers.paths", {}))) paths[p] = num(x && x.bytes) || 0;
    const sample = {
      lookups: num(get(stats, "tiers.lookups", null)) || 0,
      hits,
      tiers: Object.keys(get(stats, "tiers.tiers", {})),
      gen: num(get(stats, "generated_tokens", null)),
      prompt: num(get(stats, "prompt_tokens", null)),
      paths,
      running: num(get(stats, "scheduler.running", null)),
      waiting: num(get(stats, "scheduler.waiting", null)),
    };
    for (const p of plugins()) {
      try { if (p.record) p.record(stats, sample, state.lib); } catch (e) { console.error("strata dashboard: panel failed", e); }
    }
    return sample;
  }
  state.figuresOf = figuresOf;

  function trim() {
    const samples = state.samples;
    if (!samples.length) return;
    const oldest = samples[samples.length - 1].t - KEEP_S;
    let k = 0;
    while (k < samples.length && samples[k].t < oldest) k++;
    k = Math.max(k, samples.length - MAX_SAMPLES);
    if (k > 0) samples.splice(0, k);
  }

  // a history answer: the first one with samples replaces the page's own; later ones add what is new
  function ingest(body) {
    const fresh = Array.isArray(body.samples) ? body.samples.filter((s) => s && num(s.t) !== null) : [];
    if (!fresh.length) return;
    const steps = Array.isArray(body.steps_s) ? body.steps_s : [], spans = Array.isArray(body.spans_s) ? body.spans_s : [];
    state.historyNote = steps.map((step, i) => `${i ? "then one per " : "one point every "}${D.fmtDuration(step)} ` +
      `${i ? "up to" : "for the last"} ${D.fmtDuration(spans[i])}`).join(", ") + " (kept by the server: full when the page opens)";
    if (state.source !== "server") {
      state.samples = fresh;
      state.source = "server";
      state.openedAt = num(body.now);
      state.historySamples = fresh.length;
      document.body.dataset.openedAt = String(body.now);
      document.body.dataset.historySamples = String(fresh.length);
    } else {
      const last = state.samples.length ? state.samples[state.samples.length - 1].t : -Infinity;
      for (const s of fresh) if (s.t > last) state.samples.push(s);
    }
    trim();
  }

  // ---- polling ---------------------------------------------------------------------------------
  async function getJSON(url) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), Math.max(3000, 3 * INTERVAL_MS));
    try {
      const auth = window.strataAuth ? window.strataAuth.headers() : {};  // the API key, if the server has one
      const resp = await fetch(url, { cache: "no-store", signal: ctl.signal, headers: { Accept: "application/json", ...auth } });
      let body = null;
      try { body = await resp.json(); } catch (e) { body = null; }
      return { status: resp.status, ok: resp.ok, body };
    } finally {
      clearTimeout(timer);
    }
  }

  function setState(name, label) {
    document.body.dataset.state = name;
    setText("status", label);
  }

  function historyURL() {
    const last = state.samples.length ? state.samples[state.samples.length - 1].t : null;
    return "v1/strata/history" + (state.source === "server" && last !== null ? "?since=" + last : "");
  }

  async function poll() {
    const started = performance.now();
    const [stats, grid, history] = await Promise.allSettled([
      getJSON("v1/strata/stats"), getJSON("v1/strata/residency"), getJSON(historyURL())]);
    const answered = (r) => r.status === "fulfilled" && r.value.ok && r.value.body && typeof r.value.body === "object";
    if (window.strataAuth && [stats, grid, history].some((r) => r.status === "fulfilled" && r.value.status === 401)) {
      setState("locked", "API key needed");  // polling waits for a key (dashboard_auth.js's form)
      window.strataAuth.refused().then(poll);
      return;
    }
    if (answered(history)) {
      state.historyPolls++;
      ingest(history.value.body);
    } else if (history.status === "fulfilled" && [404, 503].includes(history.value.status)) {
      state.source = state.source === "server" ? "server" : "page";  // no history here (yet): sample the polls
    }
    if (answered(stats)) {
      state.stats = stats.value.body;
      state.polls++;
      if (state.source !== "server") {
        state.source = "page";
        state.samples.push({ t: performance.now() / 1000, ...figuresOf(state.stats) });
        trim();
      }
      setState("live", "live");
      setText("updated", "updated " + new Date().toLocaleTimeString("en-GB"));
    } else if (stats.status === "fulfilled" && stats.value.status === 503) {
      setState("loading", "loading model…");
    } else {
      state.errors++;
      setState("offline", "offline — retrying");
    }
    if (answered(grid) && Array.isArray(grid.value.body.tier)) {
      state.grid = grid.value.body;
      const t = performance.now() / 1000;
      state.grids.push({ t, grid: state.grid });
      while (state.grids.length > 1 && state.grids[0].t < t - GRID_KEEP_S) state.grids.shift();
      state.gridPolls++;
    }
    try {
      renderAll();
    } catch (e) {
      console.error("strata dashboard: render failed", e);
    }
    document.body.dataset.source = state.source || "";
    setText("history-note", state.source === "server" ? state.historyNote
      : state.source === "page" ? "points from this page's own polls since it opened (the server keeps no history)" : "—");
    document.body.dataset.polls = String(state.polls);
    document.body.dataset.gridPolls = String(state.gridPolls);
    document.body.dataset.samples = String(state.samples.length);
    setTimeout(poll, Math.max(50, INTERVAL_MS - (performance.now() - started)));
  }

  function start() {
    setText("interval", String(INTERVAL_MS / 1000));
    for (const id of ["hit-window", "span"]) $(id).addEventListener("change", renderAll);
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(renderAll, 100);
    });
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();

// strata tier dashboard: polls /v1/strata/stats and /v1/strata/residency and draws them on <canvas>.
// Plain JavaScript, no dependencies, nothing loaded from anywhere but this server.
"use strict";

(function () {
  const TIERS = ["gpu", "pinned", "tmpfs", "disk"];
  const HISTORY = 600;        // samples kept (10 minutes at 1 s)
  const SPAN_S = 180;         // seconds shown by the line charts
  const GRID_HISTORY = 11;    // residency grids kept for the "last 10 s" traffic view
  const params = new URLSearchParams(location.search);
  const INTERVAL_MS = Math.max(200, Number(params.get("interval")) || 1000);

  const $ = (id) => document.getElementById(id);
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";

  // ---- state -----------------------------------------------------------------------------------
  const state = {
    samples: [],      // {t, lookups, hits{tier}, gen, prompt, paths{path: bytes}, running, waiting}
    grids: [],        // recent residency grids (newest last)
    stats: null,
    grid: null,
    polls: 0,
    gridPolls: 0,
    errors: 0,
  };
  window.strataDashboard = state;  // for debugging and tests

  // ---- small helpers ---------------------------------------------------------------------------
  function get(obj, path, fallback) {
    let cur = obj;
    for (const key of path.split(".")) {
      if (cur === null || cur === undefined || typeof cur !== "object" || !(key in cur)) return fallback;
      cur = cur[key];
    }
    return cur === null || cur === undefined ? fallback : cur;
  }
  const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);

  function fmtNum(v, digits = 0) {
    if (num(v) === null) return "—";
    return v.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  }
  function fmtPct(v) { return num(v) === null ? "—" : (100 * v).toFixed(1) + "%"; }
  function fmtBytes(v) {
    if (num(v) === null) return "—";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }
  function fmtRate(v) { return num(v) === null ? "—" : fmtBytes(v) + "/s"; }
  function fmtSeconds(v) {
    if (num(v) === null) return "—";
    if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 2 : 0) + " ms";
    if (v < 120) return v.toFixed(1) + " s";
    if (v < 7200) return (v / 60).toFixed(1) + " min";
    return (v / 3600).toFixed(1) + " h";
  }
  function fmtShort(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
    if (a >= 10) return v.toFixed(0);
    if (a >= 1) return v.toFixed(1);
    return v.toFixed(2);
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
  // a y axis for values up to `max`: about four ticks at 1/2/5 x 10^k steps
  function niceScale(max, integer) {
    if (!(max > 0)) max = integer ? 4 : 1;
    const raw = max / 4, p = Math.pow(10, Math.floor(Math.log10(raw)));
    let step = [1, 2, 5, 10].map((m) => m * p).find((v) => v >= raw) || 10 * p;
    if (integer) step = Math.max(1, Math.round(step));
    return { step, top: Math.ceil((max * 1.05) / step) * step };
  }
  function fitCanvas(canvas, cssHeight) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(50, canvas.clientWidth || canvas.parentElement.clientWidth || 300);
    const h = cssHeight || canvas.clientHeight || 180;
    if (cssHeight) canvas.style.height = cssHeight + "px";
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  }

  // ---- line chart ------------------------------------------------------------------------------
  // series: [{color, points: [[t, value|null], ...]}]; t in seconds on the sample clock.
  function drawLineChart(canvas, series, opts) {
    const { ctx, w, h } = fitCanvas(canvas);
    const now = opts.now, span = opts.span || SPAN_S, format = opts.format || fmtShort;
    let ymax = opts.yMax, step = opts.yStep;
    if (ymax === undefined) {
      let m = 0;
      for (const s of series) for (const [t, v] of s.points) if (v !== null && t >= now - span && v > m) m = v;
      ({ step, top: ymax } = niceScale(m, opts.integer));
    }
    ctx.font = "11px system-ui, sans-serif";
    let labelWidth = 0;
    for (let v = 0; v <= ymax + 1e-9; v += step) labelWidth = Math.max(labelWidth, ctx.measureText(format(v)).width);
    const pad = { l: Math.max(36, Math.ceil(labelWidth) + 10), r: 10, t: 8, b: 20 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    const x = (t) => pad.l + pw * (1 - (now - t) / span);
    const y = (v) => pad.t + ph * (1 - Math.min(v, ymax) / ymax);
    ctx.lineWidth = 1;
    ctx.strokeStyle = "#26313d";
    ctx.fillStyle = "#8293a5";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = 0, n = Math.round(ymax / step); i <= n; i++) {
      const v = i * step, yy = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
      ctx.fillText(format(v), pad.l - 6, yy);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let s = 0; s <= span; s += 30) {
      const xx = Math.round(x(now - s)) + 0.5;
      ctx.beginPath(); ctx.moveTo(xx, pad.t); ctx.lineTo(xx, pad.t + ph); ctx.stroke();
      ctx.fillText(s === 0 ? "now" : "-" + s + "s", Math.min(Math.max(xx, pad.l + 12), w - pad.r - 12), pad.t + ph + 4);
    }
    let drawn = 0;
    ctx.save();
    ctx.beginPath(); ctx.rect(pad.l, pad.t - 2, pw, ph + 4); ctx.clip();
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      let run = [];
      const flush = () => {
        if (run.length === 1) {
          ctx.beginPath(); ctx.arc(run[0][0], run[0][1], 2, 0, 2 * Math.PI); ctx.fill();
        } else if (run.length > 1) {
          ctx.beginPath();
          run.forEach(([px, py], i) => (i ? ctx.lineTo(px, py) : ctx.moveTo(px, py)));
          ctx.stroke();
        }
        run = [];
      };
      for (const [t, v] of s.points) {
        if (t < now - span - 5) continue;
        if (v === null) { flush(); continue; }
        run.push([x(t), y(v)]);
        drawn++;
      }
      flush();
    }
    ctx.restore();
    canvas.dataset.points = String(drawn);
  }

  // ---- heatmaps --------------------------------------------------------------------------------
  const RAMP = [[16, 21, 28], [59, 15, 112], [140, 41, 129], [222, 73, 104], [254, 159, 109], [252, 253, 191]];
  function rampColor(f) {
    f = Math.max(0, Math.min(1, f)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(f)), u = f - i;
    const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * u));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function mapGeometry(canvas, layers, experts) {
    const gutter = 40, top = 16;
    const avail = Math.max(50, (canvas.clientWidth || canvas.parentElement.clientWidth || 400) - gutter - 4);
    const cw = Math.max(1, Math.min(28, Math.floor(avail / Math.max(1, experts))));
    const ch = Math.max(3, Math.min(22, Math.max(cw, Math.floor(120 / Math.max(1, layers)))));
    return { gutter, top, cw, ch, height: top + layers * ch + 4 };
  }

  // colorOf(row, col) -> CSS colour or null (not drawn)
  function drawMap(canvas, grid, colorOf) {
    const layers = grid.layers.length, experts = grid.experts;
    const g = mapGeometry(canvas, layers, experts);
    const { ctx } = fitCanvas(canvas, g.height);
    canvas._geom = g;
    const gap = g.cw >= 5 && g.ch >= 5 ? 1 : 0;
    let cells = 0;
    for (let r = 0; r < layers; r++) {
      for (let c = 0; c < experts; c++) {
        const color = colorOf(r, c);
        if (!color) continue;
        ctx.fillStyle = color;
        ctx.fillRect(g.gutter + c * g.cw, g.top + r * g.ch, g.cw - gap, g.ch - gap);
        cells++;
      }
    }
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#8293a5";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const rowStep = Math.max(1, Math.ceil(12 / g.ch));
    for (let r = 0; r < layers; r += rowStep) ctx.fillText("L" + grid.layers[r], g.gutter - 4, g.top + r * g.ch + g.ch / 2);
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const colStep = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512].find((s) => s * g.cw >= 22) || 1024;
    for (let c = 0; c < experts; c += colStep) ctx.fillText(String(c), g.gutter + c * g.cw + g.cw / 2, 2);
    canvas.dataset.cells = String(cells);
    canvas.dataset.layers = String(layers);
    canvas.dataset.experts = String(experts);
    return cells;
  }

  function trafficOf(grid) {
    if (!grid || !Array.isArray(grid.traffic)) return null;
    const windowS = Number($("traffic-window").value);
    if (!windowS) return grid.traffic;
    const old = state.grids.length > windowS ? state.grids[state.grids.length - 1 - windowS] : state.grids[0];
    if (!old || !Array.isArray(old.traffic) || old === grid || old.experts !== grid.experts
        || old.layers.join() !== grid.layers.join()) return grid.traffic;
    return grid.traffic.map((row, r) => row.map((v, c) => Math.max(0, v - (old.traffic[r][c] || 0))));
  }

  function drawGrid() {
    const grid = state.grid;
    const resCanvas = $("heatmap"), trafCanvas = $("traffic-map");
    if (!grid || !Array.isArray(grid.tier) || !grid.layers || !grid.layers.length) {
      for (const c of [resCanvas, trafCanvas]) { fitCanvas(c, 40); c.dataset.cells = "0"; }
      return;
    }
    document.querySelector(".maps").classList.toggle("stacked", grid.experts > 96);
    const tiers = Array.isArray(grid.tiers) ? grid.tiers : TIERS;
    const colors = tiers.map((t) => css("--" + t));
    const counts = {};
    for (const t of tiers) counts[t] = 0;
    for (const row of grid.tier) for (const i of row) if (i >= 0 && tiers[i] !== undefined) counts[tiers[i]]++;
    const present = Array.isArray(grid.present) ? grid.present : tiers;
    for (const t of TIERS) {
      setText("count-" + t, present.includes(t) ? fmtNum(counts[t] || 0) : "—", present.includes(t) ? counts[t] || 0 : null);
      const li = document.querySelector(`#count-legend li[data-tier="${t}"]`);
      if (li) li.classList.toggle("absent", !present.includes(t));
    }
    drawMap(resCanvas, grid, (r, c) => {
      const i = grid.tier[r][c];
      return i >= 0 ? colors[i] || "#888" : null;
    });
    const traffic = trafficOf(grid);
    $("traffic-note").hidden = traffic !== null;
    $("traffic-ramp").hidden = traffic === null;
    if (traffic === null) {
      fitCanvas(trafCanvas, 40);
      trafCanvas.dataset.cells = "0";
      setText("traffic-max", "—");
      return;
    }
    let max = 0;
    for (const row of traffic) for (const v of row) if (v > max) max = v;
    const lmax = Math.log1p(max) || 1;
    setText("traffic-max", fmtNum(max), max);
    drawMap(trafCanvas, grid, (r, c) => {
      if (grid.tier[r][c] < 0) return null;
      return rampColor(Math.log1p(traffic[r][c] || 0) / lmax);
    });
  }

  function setupTooltip() {
    const tip = $("tooltip");
    for (const canvas of [$("heatmap"), $("traffic-map")]) {
      canvas.addEventListener("mousemove", (ev) => {
        const grid = state.grid, g = canvas._geom;
        if (!grid || !g) return;
        const rect = canvas.getBoundingClientRect();
        const px = ev.clientX - rect.left, py = ev.clientY - rect.top;
        const c = Math.floor((px - g.gutter) / g.cw), r = Math.floor((py - g.top) / g.ch);
        if (r < 0 || c < 0 || r >= grid.layers.length || c >= grid.experts) { tip.hidden = true; return; }
        const tiers = grid.tiers || TIERS;
        const ti = grid.tier[r][c];
        const traffic = trafficOf(grid);
        let text = `layer ${grid.layers[r]} · expert ${c} · ${ti >= 0 ? tiers[ti] : "not stored"}`;
        if (traffic) text += ` · ${fmtNum(traffic[r][c] || 0)} lookups`;
        if (Array.isArray(grid.layer_lookups)) text += ` (layer: ${fmtNum(grid.layer_lookups[r] || 0)})`;
        tip.textContent = text;
        const host = canvas.closest(".panel").getBoundingClientRect();
        tip.style.left = Math.min(ev.clientX - host.left + 12, host.width - 260) + "px";
        tip.style.top = ev.clientY - host.top + 14 + "px";
        tip.hidden = false;
      });
      canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
    }
  }

  // ---- derived series --------------------------------------------------------------------------
  function rateSeries(samples, pick, window) {
    // value per second of a cumulative counter over up to `window` samples, from the oldest one in the window
    // that has the counter (a panel's first samples may predate it); null across resets and where none has it
    const out = [];
    for (let i = 1; i < samples.length; i++) {
      const b = samples[i], vb = pick(b);
      let rate = null;
      for (let j = Math.max(0, i - window); j < i && vb !== null; j++) {
        const va = pick(samples[j]), dt = b.t - samples[j].t;
        if (va === null) continue;
        rate = dt > 0 && vb >= va ? (vb - va) / dt : null;
        break;
      }
      out.push([b.t, rate]);
    }
    return out;
  }

  function hitSeries(samples, tier, window) {
    const out = [];
    for (let i = 0; i < samples.length; i++) {
      const b = samples[i];
      if (!window) {
        out.push([b.t, b.lookups > 0 ? (b.hits[tier] || 0) / b.lookups : null]);
        continue;
      }
      if (i === 0) continue;
      const a = samples[Math.max(0, i - window)];
      const dl = b.lookups - a.lookups, dh = (b.hits[tier] || 0) - (a.hits[tier] || 0);
      out.push([b.t, dl > 0 && dh >= 0 ? dh / dl : null]);
    }
    return out;
  }

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
    const live = rateSeries(state.samples, (x) => x.gen, 5).pop();
    setText("throughput", live && live[1] !== null ? fmtNum(live[1], 1) : "—", live ? live[1] : null);
    const running = num(get(s, "scheduler.running", null)), waiting = num(get(s, "scheduler.waiting", null));
    setText("running", fmtNum(running), running);
    setText("waiting", fmtNum(waiting), waiting);
    for (const [id, key] of [["requests", "requests"], ["prompt-tokens", "prompt_tokens"], ["gen-tokens", "generated_tokens"]]) {
      const v = num(get(s, key, null));
      setText(id, fmtNum(v), v);
    }
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

    // hit ratios (legend: since start, as the server computes them)
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
    const live = {};
    for (const p of names) {
      const r = rateSeries(state.samples, (x) => (p in x.paths ? x.paths[p] : null), 5).pop();
      live[p] = r ? r[1] : null;
    }
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
        el("td", { text: fmtRate(live[p]) }),
        el("td", { text: gbps === null ? "—" : gbps.toFixed(3) + " GB/s" }),
      ]);
    }));
  }

  function renderCharts() {
    const samples = state.samples;
    const now = samples.length ? samples[samples.length - 1].t : 0;
    const hitWindow = Number($("hit-window").value);
    const present = TIERS.filter((t) => samples.some((x) => t in x.hits || x.tiers.includes(t)));
    drawLineChart($("hit-chart"), present.map((t) => ({ color: css("--" + t), points: hitSeries(samples, t, hitWindow) })),
      { now, yMax: 1, yStep: 0.25, format: (v) => Math.round(v * 100) + "%" });
    drawLineChart($("tok-chart"), [
      { color: css("--tok"), points: rateSeries(samples, (x) => x.gen, 1) },
      { color: css("--prompt"), points: rateSeries(samples, (x) => x.prompt, 1) },
    ], { now });
    drawLineChart($("req-chart"), [
      { color: css("--running"), points: samples.map((x) => [x.t, x.running]) },
      { color: css("--waiting"), points: samples.map((x) => [x.t, x.waiting]) },
    ], { now, integer: true });
    const paths = [...new Set(samples.flatMap((x) => Object.keys(x.paths)))].sort();
    drawLineChart($("bw-chart"), paths.map((p, i) => ({
      color: pathColor(p, i), points: rateSeries(samples, (x) => (p in x.paths ? x.paths[p] : null), 1),
    })), { now, format: (v) => fmtShort(v) + "B/s" });
  }

  // stacked bars: one per MoE layer, height = lookups, split by the tier that answered
  function drawLayerChart() {
    const canvas = $("layer-chart");
    const layers = get(state.stats || {}, "tiers.layers", {});
    const ids = Object.keys(layers).map(Number).filter((x) => isFinite(x)).sort((a, b) => a - b);
    const { ctx, w, h } = fitCanvas(canvas);
    const pad = { l: 48, r: 10, t: 8, b: 20 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    let max = 0, worst = null;
    for (const id of ids) {
      const x = layers[id] || {};
      max = Math.max(max, num(x.lookups) || 0);
      const rate = x.lookups ? (num(x.misses) || 0) / x.lookups : 0;
      if (x.lookups && (!worst || rate > worst.rate)) worst = { id, rate, stall: num(x.stall_seconds) || 0 };
    }
    const { step, top } = niceScale(max, true);
    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#26313d";
    ctx.fillStyle = "#8293a5";
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
    let bars = 0;
    ids.forEach((id, i) => {
      const hits = (layers[id] || {}).hits || {};
      let y0 = pad.t + ph;
      for (const t of [...order, ...Object.keys(hits).filter((k) => !order.includes(k))]) {
        const n = num(hits[t]) || 0;
        if (!n) continue;
        const hh = (ph * n) / top;
        ctx.fillStyle = TIERS.includes(t) ? css("--" + t) : "#888";
        ctx.fillRect(pad.l + i * bw + gap / 2, y0 - hh, Math.max(1, bw - gap), hh);
        y0 -= hh;
      }
      if ((layers[id] || {}).lookups) bars++;
    });
    ctx.fillStyle = "#8293a5";
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.max(1, Math.ceil(24 / Math.max(1, bw)));
    ids.forEach((id, i) => { if (i % every === 0) ctx.fillText("L" + id, pad.l + (i + 0.5) * bw, pad.t + ph + 4); });
    canvas.dataset.bars = String(bars);
    setText("worst-layer", worst ? `most misses: layer ${worst.id} (${fmtPct(worst.rate)}, stalled ${fmtSeconds(worst.stall)})` : "");
  }

  // panels in other scripts (dashboard_engram.js) register in window.strataDashboardPlugins:
  // {record(stats, sample): add fields to the sample, render(state, lib): draw}. Read on every poll.
  const plugins = () => (Array.isArray(window.strataDashboardPlugins) ? window.strataDashboardPlugins : []);
  state.lib = { $, css, get, num, fmtNum, fmtPct, fmtBytes, fmtRate, fmtSeconds, fmtShort, setText, el,
                drawLineChart, rateSeries, SPAN_S };

  function renderAll() {
    renderStats();
    drawLayerChart();
    renderCharts();
    drawGrid();
    for (const p of plugins()) {
      try { if (p.render) p.render(state, state.lib); } catch (e) { console.error("strata dashboard: panel failed", e); }
    }
  }

  // ---- polling ---------------------------------------------------------------------------------
  async function getJSON(url) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), Math.max(3000, 3 * INTERVAL_MS));
    try {
      const resp = await fetch(url, { cache: "no-store", signal: ctl.signal, headers: { Accept: "application/json" } });
      let body = null;
      try { body = await resp.json(); } catch (e) { body = null; }
      return { status: resp.status, ok: resp.ok, body };
    } finally {
      clearTimeout(timer);
    }
  }

  function record(stats) {
    const t = performance.now() / 1000;
    const hits = {};
    for (const [tier, x] of Object.entries(get(stats, "tiers.tiers", {}))) hits[tier] = num(x && x.hits) || 0;
    const paths = {};
    for (const [p, x] of Object.entries(get(stats, "tiers.paths", {}))) paths[p] = num(x && x.bytes) || 0;
    const sample = {
      t,
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
    state.samples.push(sample);
    if (state.samples.length > HISTORY) state.samples.splice(0, state.samples.length - HISTORY);
  }

  function setState(name, label) {
    document.body.dataset.state = name;
    setText("status", label);
  }

  async function poll() {
    const started = performance.now();
    const [stats, grid] = await Promise.allSettled([getJSON("v1/strata/stats"), getJSON("v1/strata/residency")]);
    if (stats.status === "fulfilled" && stats.value.ok && stats.value.body && typeof stats.value.body === "object") {
      state.stats = stats.value.body;
      state.polls++;
      record(state.stats);
      setState("live", "live");
      setText("updated", "updated " + new Date().toLocaleTimeString("en-GB"));
    } else if (stats.status === "fulfilled" && stats.value.status === 503) {
      setState("loading", "loading model…");
    } else {
      state.errors++;
      setState("offline", "offline — retrying");
    }
    if (grid.status === "fulfilled" && grid.value.ok && grid.value.body && Array.isArray(grid.value.body.tier)) {
      state.grid = grid.value.body;
      state.grids.push(state.grid);
      if (state.grids.length > GRID_HISTORY) state.grids.shift();
      state.gridPolls++;
    }
    try {
      renderAll();
    } catch (e) {
      console.error("strata dashboard: render failed", e);
    }
    document.body.dataset.polls = String(state.polls);
    document.body.dataset.gridPolls = String(state.gridPolls);
    setTimeout(poll, Math.max(50, INTERVAL_MS - (performance.now() - started)));
  }

  function start() {
    setText("interval", String(INTERVAL_MS / 1000));
    $("hit-window").addEventListener("change", renderCharts);
    $("traffic-window").addEventListener("change", drawGrid);
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(renderAll, 100);
    });
    setupTooltip();
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();

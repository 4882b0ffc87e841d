// strata tier dashboard, drawing: number formats, windowed rates of cumulative counters, line charts and heatmaps
// on <canvas>. Plain JavaScript, no dependencies; dashboard.js and the panels use it as window.strataDraw.
"use strict";

(function () {
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
  const GRID = "#26313d", LABEL = "#8293a5";

  // ---- numbers -----------------------------------------------------------------------------------
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
  function fmtDuration(s) {  // whole units where they fit: 30 s, 5 min, 1 h
    const n = (v) => (Number.isInteger(v) ? String(v) : fmtShort(v));
    if (s < 60 || s % 60) return n(s) + " s";
    if (s < 3600 || s % 3600) return n(s / 60) + " min";
    return n(s / 3600) + " h";
  }
  function fmtAgo(s) {  // an x-axis tick s seconds before now
    return s === 0 ? "now" : "-" + fmtDuration(s).replace(" ", "");
  }

  // ---- series of samples ({t, ...cumulative counters}, oldest first) --------------------------------
  // For each sample i > 0, the sample that opens its window of `windowS` seconds: the newest one at least
  // windowS old (less a little clock jitter), else the oldest one (a partial window while history is short).
  // Samples further apart than the window (the history's 10 s steps) open each other's window.
  function windowStarts(samples, windowS) {
    const tol = Math.min(0.25 * windowS, 0.5), out = new Array(samples.length).fill(-1);
    let j = 0;
    for (let i = 1; i < samples.length; i++) {
      const limit = samples[i].t - windowS + tol;
      while (j + 1 < i && samples[j + 1].t <= limit) j++;
      out[i] = j;
    }
    return out;
  }

  // per second over each sample's window of a cumulative counter: [[t, rate | null]]; null where either end
  // lacks the counter or it went down (its source restarted)
  function rateSeries(samples, pick, windowS) {
    const starts = windowStarts(samples, windowS), out = [];
    for (let i = 1; i < samples.length; i++) {
      const a = samples[starts[i]], b = samples[i], va = pick(a), vb = pick(b);
      const ok = va !== null && vb !== null && va !== undefined && vb !== undefined && vb >= va && b.t > a.t;
      out.push([b.t, ok ? (vb - va) / (b.t - a.t) : null]);
    }
    return out;
  }

  // share of `part` in `whole` (cumulative counters): since start (windowS 0) or over each sample's window
  function shareSeries(samples, part, whole, windowS) {
    const out = [];
    if (!windowS) {
      for (const s of samples) {
        const p = part(s), w = whole(s);
        if (p !== null && w !== null) out.push([s.t, w > 0 ? p / w : null]);
      }
      return out;
    }
    const starts = windowStarts(samples, windowS);
    for (let i = 1; i < samples.length; i++) {
      const a = samples[starts[i]], b = samples[i];
      const pa = part(a), pb = part(b), wa = whole(a), wb = whole(b);
      if (pa === null || pb === null || wa === null || wb === null) continue;
      out.push([b.t, wb - wa > 0 && pb - pa >= 0 ? (pb - pa) / (wb - wa) : null]);
    }
    return out;
  }

  // ---- canvas --------------------------------------------------------------------------------------
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

  // series: [{color, points: [[t, value | null], ...]}] with t in seconds; opts: {now, span, yMax, yStep, integer,
  // format}. Sets data-points (values drawn), data-first-t (the oldest drawn t), data-colors (the colours of
  // the series that drew something), data-plot ([left, top, width, height] of the plot area), data-now and
  // data-span on the canvas.
  function drawLineChart(canvas, series, opts) {
    const { ctx, w, h } = fitCanvas(canvas);
    const now = opts.now, span = opts.span || 180, format = opts.format || fmtShort;
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
    ctx.strokeStyle = GRID;
    ctx.fillStyle = LABEL;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = 0, n = Math.round(ymax / step); i <= n; i++) {
      const v = i * step, yy = Math.round(y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(w - pad.r, yy); ctx.stroke();
      ctx.fillText(format(v), pad.l - 6, yy);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const tick = [15, 30, 60, 120, 300, 600, 900, 1800].find((s) => span / s <= 6) || 3600;
    for (let s = 0; s <= span; s += tick) {
      const xx = Math.round(x(now - s)) + 0.5;
      ctx.beginPath(); ctx.moveTo(xx, pad.t); ctx.lineTo(xx, pad.t + ph); ctx.stroke();
      ctx.fillText(fmtAgo(s), Math.min(Math.max(xx, pad.l + 12), w - pad.r - 12), pad.t + ph + 4);
    }
    let drawn = 0, first = null;
    const colors = [];
    ctx.save();
    ctx.beginPath(); ctx.rect(pad.l, pad.t - 2, pw, ph + 4); ctx.clip();
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 2;
      ctx.lineJoin = "round";
      let run = [], mine = 0;
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
        if (t < now - span) continue;
        if (v === null) { flush(); continue; }
        run.push([x(t), y(v)]);
        mine++;
        if (first === null || t < first) first = t;
      }
      flush();
      drawn += mine;
      if (mine && !colors.includes(s.color)) colors.push(s.color);
    }
    ctx.restore();
    canvas.dataset.points = String(drawn);
    canvas.dataset.colors = JSON.stringify(colors);
    canvas.dataset.plot = JSON.stringify([pad.l, pad.t, pw, ph]);  // the plot area in CSS pixels of the canvas
    canvas.dataset.now = String(now);  // the t at the right edge, `span` seconds after the left one
    canvas.dataset.span = String(span);
    if (first === null) delete canvas.dataset.firstT;
    else canvas.dataset.firstT = String(first);
  }

  // ---- heatmaps ------------------------------------------------------------------------------------
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

  // colorOf(row, col) -> CSS colour or null (not drawn); sets data-cells, data-layers, data-experts
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
    ctx.fillStyle = LABEL;
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

  window.strataDraw = { css, num, fmtNum, fmtPct, fmtBytes, fmtRate, fmtSeconds, fmtShort, fmtDuration, fmtAgo, windowStarts,
                        rateSeries, shareSeries, niceScale, fitCanvas, drawLineChart, rampColor, mapGeometry, drawMap,
                        GRID, LABEL };
})();

// strata dashboard, experts panel: the layers x experts heatmaps of residency (the fastest tier holding each
// expert, now) and traffic (lookups per expert, since start or over the last 10 s), with a tooltip per cell.
// Reads /v1/strata/residency (dashboard.js polls it into state.grid, and keeps the last grids in state.grids as
// [{t, grid}]). Registers itself in window.strataDashboardPlugins (see dashboard_engram.js).
"use strict";

(function () {
  const TIERS = ["gpu", "pinned", "tmpfs", "disk"];
  const D = window.strataDraw;
  const $ = (id) => document.getElementById(id);
  let state = null, lib = null;  // dashboard.js's, from the first render

  function trafficOf(grid) {
    if (!grid || !Array.isArray(grid.traffic)) return null;
    const windowS = Number($("traffic-window").value);
    if (!windowS || !state.grids.length) return grid.traffic;
    const newest = state.grids[state.grids.length - 1].t;
    let old = state.grids[0].grid;
    for (const g of state.grids) if (g.t <= newest - windowS + 0.5) old = g.grid;
    if (!old || !Array.isArray(old.traffic) || old === grid || old.experts !== grid.experts
        || old.layers.join() !== grid.layers.join()) return grid.traffic;
    return grid.traffic.map((row, r) => row.map((v, c) => Math.max(0, v - (old.traffic[r][c] || 0))));
  }

  function drawGrid() {
    const grid = state.grid;
    const resCanvas = $("heatmap"), trafCanvas = $("traffic-map");
    if (!grid || !Array.isArray(grid.tier) || !grid.layers || !grid.layers.length) {
      for (const c of [resCanvas, trafCanvas]) { D.fitCanvas(c, 40); c.dataset.cells = "0"; }
      return;
    }
    lib.setText("traffic-scope", lib.windowLabel($("traffic-window").value));
    document.querySelector(".maps").classList.toggle("stacked", grid.experts > 96);
    const tiers = Array.isArray(grid.tiers) ? grid.tiers : TIERS;
    const colors = tiers.map((t) => D.css("--" + t));
    const counts = {};
    for (const t of tiers) counts[t] = 0;
    for (const row of grid.tier) for (const i of row) if (i >= 0 && tiers[i] !== undefined) counts[tiers[i]]++;
    const present = Array.isArray(grid.present) ? grid.present : tiers;
    for (const t of TIERS) {
      lib.setText("count-" + t, present.includes(t) ? D.fmtNum(counts[t] || 0) : "—", present.includes(t) ? counts[t] || 0 : null);
      const li = document.querySelector(`#count-legend li[data-tier="${t}"]`);
      if (li) li.classList.toggle("absent", !present.includes(t));
    }
    D.drawMap(resCanvas, grid, (r, c) => {
      const i = grid.tier[r][c];
      return i >= 0 ? colors[i] || "#888" : null;
    });
    const traffic = trafficOf(grid);
    $("traffic-note").hidden = traffic !== null;
    $("traffic-ramp").hidden = traffic === null;
    if (traffic === null) {
      D.fitCanvas(trafCanvas, 40);
      trafCanvas.dataset.cells = "0";
      lib.setText("traffic-max", "—");
      return;
    }
    let max = 0;
    for (const row of traffic) for (const v of row) if (v > max) max = v;
    const lmax = Math.log1p(max) || 1;
    lib.setText("traffic-max", D.fmtNum(max), max);
    D.drawMap(trafCanvas, grid, (r, c) => {
      if (grid.tier[r][c] < 0) return null;
      return D.rampColor(Math.log1p(traffic[r][c] || 0) / lmax);
    });
  }

  function setupTooltip() {
    const tip = $("tooltip");
    for (const canvas of [$("heatmap"), $("traffic-map")]) {
      canvas.addEventListener("mousemove", (ev) => {
        if (!state) return;
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
        if (traffic) text += ` · ${D.fmtNum(traffic[r][c] || 0)} lookups (${lib.windowLabel($("traffic-window").value)})`;
        if (Array.isArray(grid.layer_lookups)) text += ` · layer since start: ${D.fmtNum(grid.layer_lookups[r] || 0)}`;
        tip.textContent = text;
        const host = canvas.closest(".panel").getBoundingClientRect();
        tip.style.left = Math.min(ev.clientX - host.left + 12, host.width - 260) + "px";
        tip.style.top = ev.clientY - host.top + 14 + "px";
        tip.hidden = false;
      });
      canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
    }
  }

  function render(s, l) {
    state = s;
    lib = l;
    drawGrid();
  }

  (window.strataDashboardPlugins = window.strataDashboardPlugins || []).push({ name: "experts", render });
  // deferred script: the page is parsed
  $("traffic-window").addEventListener("change", () => { if (state) drawGrid(); });
  setupTooltip();
})();

"""The live tier dashboard's page in real headless Chromium.

A real `Engine` on the tiny demo model (mixed tiers, Engram rows read from disk: tests/server/dashboard_app.py)
answers everything. The main test runs the real server (`create_app` with a real scheduler on uvicorn): traffic
first, then the page opens, and every chart must be drawn at once from the server's history, in the DOM and in a
screenshot's pixels. The others mount the dashboard on a small app whose `/v1/strata/stats` is the engine's.
Chromium (tests/server/dashboard_browser.py) is driven over the DevTools protocol on a pipe; the tests skip only
when no Chromium is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from dashboard_app import Scheduler, make_app, mixed_tier_engine
from dashboard_browser import (
    CHROMIUM_FLAGS,
    Chromium,
    colour_matches,
    hex_rgb,
    needs_chromium,
    png_summary,
    region_pixels,
    serve_app,
)

from strata.server.dashboard_history import figures_of


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with mixed_tier_engine(tiny_model_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    scheduler = Scheduler()
    with serve_app(make_app(lambda: engine, scheduler)) as url:
        yield {"url": url, "scheduler": scheduler}


@pytest.fixture
def browser():
    chrome = Chromium(needs_chromium())
    yield chrome
    chrome.close()


LINE_CHARTS = ("hit-chart", "tok-chart", "req-chart", "bw-chart", "engram-chart", "engram-io-chart")
READ_PAGE = """(() => {
  const t = (id) => { const e = document.getElementById(id); return e ? e.textContent.trim() : null; };
  const v = (id) => { const e = document.getElementById(id); return e && e.dataset.value !== undefined ? Number(e.dataset.value) : null; };
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left + scrollX, r.top + scrollY, r.width, r.height]; };
  const chart = (id) => { const c = document.getElementById(id); return {
    points: Number(c.dataset.points || 0), firstT: c.dataset.firstT === undefined ? null : Number(c.dataset.firstT),
    colors: JSON.parse(c.dataset.colors || '[]'), plot: JSON.parse(c.dataset.plot || 'null'), box: box(c),
    now: Number(c.dataset.now), span: Number(c.dataset.span),
    bars: Number(c.dataset.bars || 0), cells: Number(c.dataset.cells || 0) }; };
  const ids = ['tok-s', 'running', 'waiting', 'requests', 'gen-tokens', 'prompt-tokens', 'lookups',
               'hit-gpu', 'hit-pinned', 'hit-tmpfs', 'hit-disk', 'prefetch-precision', 'throughput',
               'count-pinned', 'count-tmpfs', 'count-disk', 'engram-lookups', 'engram-bytes', 'engram-hit-cache',
               'engram-hit-disk', 'engram-hit-pinned'];
  const s = window.strataDashboard, b = document.body.dataset;
  return {
    polls: Number(b.polls), gridPolls: Number(b.gridPolls), state: b.state, source: b.source,
    openedAt: Number(b.openedAt), historySamples: Number(b.historySamples), samples: s.samples.length,
    lastT: s.samples.length ? s.samples[s.samples.length - 1].t : null,
    ranBefore: s.samples.filter((x) => x.t < Number(b.openedAt) && x.running > 0).length,
    text: Object.fromEntries(ids.map((id) => [id, t(id)])),
    value: Object.fromEntries(ids.map((id) => [id, v(id)])),
    charts: Object.fromEntries(['hit-chart', 'tok-chart', 'req-chart', 'bw-chart', 'engram-chart', 'engram-io-chart',
                                'layer-chart', 'heatmap', 'traffic-map'].map((id) => [id, chart(id)])),
    paths: [...document.querySelectorAll('#paths tbody tr[data-path]')].map((r) => r.dataset.path),
    tiers: [...document.querySelectorAll('#tier-table tbody tr')].map((r) => r.dataset.tier),
    engramHidden: document.getElementById('engram-panel').hidden, engramTier: b.engram,
    tierColors: Object.fromEntries(['gpu', 'pinned', 'tmpfs', 'disk'].map((k) =>
      [k, getComputedStyle(document.documentElement).getPropertyValue('--' + k).trim()])),
    history: t('history-note'), hitScope: t('hit-scope'), historyNote: t('history-note'),
  };
})()"""
# what the page had, for a failure's message: its state and its last samples (t, generated tokens, Engram rows)
DUMP = """JSON.stringify({body: {...document.body.dataset}, samples: window.strataDashboard.samples.slice(-12).map((s) =>
  [s.t, s.gen, s.engram && Object.values(s.engram.hits || {}).reduce((a, b) => a + b, 0)]),
  charts: [...document.querySelectorAll('canvas')].map((c) => [c.id, c.dataset.points, c.dataset.firstT])})"""


@contextlib.contextmanager
def running_server(engine, api_key: str | None = None, wrap=lambda app: app):
    """The real server (`create_app`) over `engine`, through a real scheduler, on uvicorn (its ASGI app passed
    through `wrap` first); yields {"url", "app", "served": the wrapped app}."""
    from strata.server.app import create_app

    scheduler = engine.scheduler(max_batch=4, token_budget=256, max_queue=32)
    scheduler.start()
    app = create_app(engine, scheduler, "tiny", api_key=api_key)
    served = wrap(app)
    try:
        with serve_app(served) as url:
            yield {"url": url, "app": app, "served": served}
    finally:
        scheduler.stop(drain=False)
    assert not app.state.dashboard_sampler.running  # the sampler stopped with the server


@pytest.fixture
def real_server(engine):
    """The real server over the module's engine, without an API key."""
    with running_server(engine) as server:
        yield server


def run_traffic(url: str, clients: int, until, limit_s: float = 30) -> int:
    """`clients` threads sending completions until `until()` is true (or `limit_s` seconds have passed); the
    number of requests served."""
    done, errors = [], []
    deadline = time.monotonic() + limit_s

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            n = 0
            while not until() and time.monotonic() < deadline:
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": f"The experts of layer {i} and {n}",
                                                       "max_tokens": 12, "temperature": 0.8, "seed": n})
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                n += 1
            done.append(n)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:1]
    return sum(done)


def history(url: str) -> list[dict]:
    return httpx.get(url + "/v1/strata/history", timeout=10).json()["samples"]


def test_dashboard_live_in_chromium(real_server, engine, browser, tmp_path):
    url = real_server["url"]
    # traffic first, with the page closed: until the server's history holds 3 samples taken under traffic
    assert run_traffic(url, 3, lambda: sum(1 for s in history(url) if s["running"]) >= 3) > 0
    time.sleep(1.2)  # and one sample after it, idle
    before = history(url)
    assert sum(1 for s in before if s["running"]) >= 3, before

    browser.open(url + "/dashboard", width=1400, height=1000)
    ready = (" && ".join(f"Number(document.getElementById('{c}').dataset.points) > 0" for c in LINE_CHARTS)
             + " && Number(document.body.dataset.gridPolls) >= 1 && document.body.dataset.source === 'server'"
             " && Number(document.body.dataset.polls) >= 1")
    browser.wait_for(ready, what="every chart drawn from the server's history", dump=DUMP)
    page = browser.eval(READ_PAGE)
    stats = engine.stats()
    tiers = stats["tiers"]
    assert page["state"] == "live", page
    # the history came whole with the first answer: the samples from before the page opened
    assert page["historySamples"] >= len(before) and page["ranBefore"] >= 3, page
    for name in LINE_CHARTS:  # every chart drew points, reaching back before the page opened
        c = page["charts"][name]
        assert c["points"] > 0 and c["firstT"] is not None and c["firstT"] < page["openedAt"] - 2, (name, c, page)
    assert page["charts"]["layer-chart"]["bars"] == 2 and page["charts"]["heatmap"]["cells"] == 32
    assert page["charts"]["traffic-map"]["cells"] == 32
    # the numbers on the page are the engine's (the server is idle now)
    assert page["value"]["gen-tokens"] == stats["generated_tokens"] > 0
    assert page["value"]["requests"] == stats["requests"]
    assert page["value"]["tok-s"] == pytest.approx(stats["decode_tokens_per_s"], rel=1e-6)
    assert page["value"]["lookups"] == tiers["lookups"] > 0
    assert page["value"]["running"] == 0 and page["text"]["running"] == "0"
    for tier in ("pinned", "disk"):
        assert page["value"][f"hit-{tier}"] == pytest.approx(tiers["hit_rate"].get(tier, 0.0))
    assert page["text"]["hit-gpu"] == "—"  # no GPU tier on this host
    assert page["value"]["count-pinned"] + page["value"]["count-tmpfs"] + page["value"]["count-disk"] == 32
    assert "disk->pinned" in page["paths"] and set(page["tiers"]) == set(tiers["tiers"])
    engram = stats["engram"]
    served = sum(engram["hits"].values())
    assert not page["engramHidden"] and page["engramTier"] == "disk", page
    assert page["value"]["engram-lookups"] == engram["lookups"] > 0
    assert page["value"]["engram-bytes"] == engram["bytes_read"] > 0
    for tier in ("cache", "disk"):
        assert page["value"][f"engram-hit-{tier}"] == pytest.approx(engram["hits"].get(tier, 0) / served)
    assert page["value"]["engram-hit-pinned"] is None and page["text"]["engram-hit-pinned"] == "—"
    # live and lifetime figures say which they are
    assert page["hitScope"] == "last 10 s" and "kept by the server" in page["historyNote"]
    # the layers x experts heatmap is above the fold of a 1400 x 1000 window
    left, top, width, height = page["charts"]["heatmap"]["box"]
    assert 0 <= top and top + height <= 1000 and width > 300, page["charts"]["heatmap"]
    # the page's samples of its own polls have the server's shape: both take the same figures
    server_stats = httpx.get(url + "/v1/strata/stats").json()
    split = {"tiers": {"lookups": 9, "tiers": {"gpu": {"hits": 4}}, "devices": {
        "cuda:0": {"lookups": 5, "tiers": {"gpu": {"hits": 4}}, "pcie_bytes": 64}}, "stage_hops": {"bytes": 32}},
        "engram": {"tier": "pinned", "devices": {"cuda:0": {"hits": {"cache": 2}, "bytes_read": 8, "stall_s": 0.5}}}}
    for snapshot in (server_stats, split):
        assert browser.eval(f"window.strataDashboard.figuresOf({json.dumps(snapshot)})") == \
            json.loads(json.dumps(figures_of(snapshot)))

    # the screenshot, over the last minute: each chart's plot area holds pixels of its series' colours, and the
    # line charts' reach left of where the page opened (the page's geometry is read after the screenshot, so it is
    # at least as new as what was drawn: the page's opening sits no further left than in the picture)
    browser.eval("(() => { const s = document.getElementById('span'); s.value = '60'; s.dispatchEvent(new Event('change')); })()")
    data = browser.screenshot(tmp_path / "dashboard.png")
    shot = browser.eval(READ_PAGE)
    width_px, height_px, colours = png_summary(data)
    assert width_px == 1400 and height_px >= 1000 and colours > 20, (width_px, height_px, colours)
    if os.environ.get("STRATA_DASHBOARD_SCREENSHOT"):  # keep a copy to look at
        shutil.copyfile(tmp_path / "dashboard.png", os.environ["STRATA_DASHBOARD_SCREENSHOT"])
    for name in (*LINE_CHARTS, "layer-chart"):
        c = shot["charts"][name]
        left, top = c["box"][0] + c["plot"][0], c["box"][1] + c["plot"][1]
        drawn = colour_matches(region_pixels(data, (left, top, c["plot"][2], c["plot"][3])),
                               [hex_rgb(x) for x in c["colors"]])
        assert c["colors"] and drawn["count"] >= 20 and drawn["columns"] >= 3, (name, c, drawn)
        if name in LINE_CHARTS:
            assert c["span"] == 60, c
            opened_x = c["plot"][2] * (1 - (c["now"] - shot["openedAt"]) / c["span"])
            assert drawn["x0"] < opened_x - 3, (name, "nothing drawn before the page opened", drawn, opened_x, c)
    tier_colours = [hex_rgb(shot["tierColors"][t]) for t in ("pinned", "tmpfs", "disk")]
    heat = colour_matches(region_pixels(data, shot["charts"]["heatmap"]["box"]), tier_colours, tolerance=2)
    assert heat["count"] >= 32 * 20, heat  # 32 cells of at least 20 pixels in the tiers' colours
    traffic = region_pixels(data, shot["charts"]["traffic-map"]["box"])
    assert colour_matches(traffic, [hex_rgb("#171e26")], tolerance=30)["count"] < 0.8 * traffic.shape[0] * traffic.shape[1]

    # live: new traffic is appended to the history the page drew, and the new rows show in the 10 s window
    n_before, t_before = shot["samples"], shot["lastT"]
    engram_before = engine.stats()["engram"]["lookups"]
    assert run_traffic(url, 1, lambda: engine.stats()["engram"]["lookups"] > engram_before, limit_s=20) > 0
    target = engine.stats()["generated_tokens"]
    browser.wait_for(f"Number(document.getElementById('gen-tokens').dataset.value) >= {target}", what="the next poll",
                     dump=DUMP)
    rows = ("(() => { const s = window.strataDashboard.samples, e = (x) => x.engram ? Object.values(x.engram.hits)"
            f".reduce((a, b) => a + b, 0) : 0, base = s.filter((x) => x.t <= {t_before}).pop() || s[0];"
            " return e(s[s.length - 1]) > e(base); })()")
    browser.wait_for(f"{rows} && Number(document.getElementById('engram-chart').dataset.points) > 0",
                     what="the new Engram rows in a sample after the page opened", dump=DUMP)
    live = browser.eval(READ_PAGE)
    assert live["samples"] > n_before and live["lastT"] > t_before and live["polls"] > page["polls"], live
    assert live["value"]["engram-lookups"] > page["value"]["engram-lookups"]
    assert browser.page_errors() == []


API_KEY = "dash+board/Key-7"  # a "+" and a "/": the fragment carries them as typed


class Requests:
    """ASGI wrapper: what each HTTP request sent (path, query string, Authorization and Cookie headers)."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            self.seen.append({"path": scope["path"], "query": scope["query_string"].decode(),
                              "auth": headers.get(b"authorization", b"").decode(),
                              "cookie": headers.get(b"cookie", b"").decode()})
        await self.app(scope, receive, send)


def test_dashboard_with_an_api_key(engine, browser):
    with running_server(engine, API_KEY, wrap=Requests) as server:
        url, seen = server["url"], server["served"].seen
        # the key in the fragment: the charts get the key-guarded data, and the key leaves the address at once
        browser.open(url + "/dashboard?interval=500#key=" + API_KEY)
        browser.wait_for("document.body.dataset.state === 'live' && document.body.dataset.source === 'server'"
                         " && Number(document.body.dataset.gridPolls) >= 1"
                         " && Number(document.getElementById('req-chart').dataset.points) > 0",
                         what="the charts drawn from the key-guarded routes", dump=DUMP)
        page = browser.eval(READ_PAGE)
        stats = engine.stats()
        assert page["value"]["gen-tokens"] == stats["generated_tokens"] > 0
        assert page["value"]["lookups"] == stats["tiers"]["lookups"] > 0 and page["charts"]["heatmap"]["cells"] == 32
        assert page["charts"]["req-chart"]["points"] > 0
        href = browser.eval("location.href")
        assert API_KEY not in href and "key=" not in href and href.endswith("/dashboard?interval=500"), href
        assert browser.eval("sessionStorage.getItem('strata.apiKey')") == API_KEY
        assert browser.eval("document.getElementById('key-form').hidden") is True
        polls = [r for r in seen if r["path"].startswith("/v1/strata/")]
        assert polls and all(r["auth"] == "Bearer " + API_KEY for r in polls), polls
        assert all(API_KEY not in r["path"] + r["query"] + r["cookie"] for r in seen), seen

        # without one (a new tab: its own sessionStorage), the page asks; a wrong key is refused, the right one works
        browser.open(url + "/dashboard?interval=500")
        form = "!document.getElementById('key-form').hidden && document.body.dataset.state === 'locked'"
        browser.wait_for(f"{form} && document.body.dataset.keyRefused === '0'", what="the key form", dump=DUMP)
        assert browser.eval("Number(document.body.dataset.polls)") == 0
        submit = ("(() => { document.getElementById('key-input').value = {key}; "
                  "document.getElementById('key-form').requestSubmit(); })()")
        browser.eval(submit.replace("{key}", json.dumps("wrong-key")))
        browser.wait_for(f"{form} && document.body.dataset.keyRefused === '1'", what="the wrong key refused", dump=DUMP)
        assert "refused" in browser.eval("document.getElementById('key-error').textContent")
        assert browser.eval("sessionStorage.getItem('strata.apiKey')") is None
        browser.eval(submit.replace("{key}", json.dumps(API_KEY)))
        browser.wait_for("document.body.dataset.state === 'live' && Number(document.body.dataset.polls) >= 1",
                         what="the page live with the typed key", dump=DUMP)
        assert browser.eval("Number(document.getElementById('gen-tokens').dataset.value)") == stats["generated_tokens"]
        assert browser.eval("sessionStorage.getItem('strata.apiKey')") == API_KEY
        assert all(API_KEY not in r["path"] + r["query"] + r["cookie"] for r in seen), seen
        assert browser.page_errors() == []


def test_engram_panel_hidden_without_engram(engine, browser):
    class NoEngram:  # the same tiers, but a model without Engram layers: stats()["engram"] is None
        tiers = engine.tiers

        def stats(self) -> dict:
            return {**engine.stats(), "engram": None}

    with serve_app(make_app(lambda: NoEngram(), Scheduler())) as url:
        browser.open(url + "/dashboard")
        browser.wait_for("Number(document.body.dataset.polls) >= 2", what="two polls")
        assert browser.eval("document.getElementById('engram-panel').hidden") is True
        assert browser.eval("document.body.dataset.engram") == ""
        assert browser.eval("Number(document.getElementById('lookups').dataset.value)") == engine.stats()["tiers"]["lookups"]
        assert browser.page_errors() == []


def test_dashboard_screenshot_cli(server, tmp_path):
    """`chromium --headless --screenshot` after a few virtual seconds of polling: a non-trivial PNG."""
    binary = needs_chromium()
    shot = tmp_path / "cli.png"
    profile = tmp_path / "profile"
    proc = subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1280,1000",
         "--virtual-time-budget=4000", server["url"] + "/dashboard"],
        capture_output=True, timeout=45)
    assert shot.exists(), proc.stderr.decode(errors="replace")[-2000:]
    width, height, colours = png_summary(shot.read_bytes())
    assert (width, height) == (1280, 1000) and colours > 20, (width, height, colours)

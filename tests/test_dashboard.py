"""The live tier dashboard: the residency grid, the routes, and the page itself in real headless Chromium.

A real uvicorn server on 127.0.0.1 serves `/v1/strata/stats` from a real `Engine` on the tiny demo
model (small pinned budget, a tmpfs tier when /dev/shm is a tmpfs, so the tiers are mixed) and mounts
the dashboard. Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
no extra Python packages, no TCP debugging port). The browser tests skip only when no Chromium is
installed; `scripts/install-browser.sh` installs one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from strata.server.dashboard import TIERS, mount_dashboard, residency_grid

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


def find_chromium() -> str | None:
    for path in (os.environ.get("STRATA_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium") or shutil.which("chromium-browser")


def needs_chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found (run scripts/install-browser.sh, or set STRATA_CHROMIUM)")
    return path


# ---- a real engine and a real server ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from strata import Engine

    config = {"tiers": {"pinned": {"budget": "120KiB"}},  # 10 of the 32 experts: evictions, disk traffic
              "engram": {"tier": "disk"}}  # Engram rows read from disk through the row cache: the Engram panel
    shm = None
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = tempfile.mkdtemp(prefix="strata-dash-", dir="/dev/shm")
        config["tiers"]["tmpfs"] = {"budget": "256KiB", "path": shm}  # one of the two MoE layers
    eng = Engine.from_pretrained(tiny_model_dir, device="cpu", config=config)
    if eng.tiers.tmpfs is not None:
        eng.tiers.tmpfs.wait(10)
    eng.generate("The experts of a mixture", max_tokens=24)
    yield eng
    eng.close()
    if shm:
        shutil.rmtree(shm, ignore_errors=True)


class Scheduler:
    """Stands in for the server's scheduler: the figures it merges into `/v1/strata/stats`."""

    def __init__(self):
        self.running, self.waiting = 1, 0

    def stats(self) -> dict:
        return {"running": self.running, "waiting": self.waiting}


def make_app(get_engine, scheduler: Scheduler | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/strata/stats")
    def stats():
        eng = get_engine()
        if eng is None:
            return {"error": {"message": "loading"}}
        out = eng.stats()
        if scheduler is not None:
            out["scheduler"] = scheduler.stats()
        return out

    mount_dashboard(app, get_engine, lambda: scheduler)
    return app


@contextlib.contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """`app` on a real uvicorn server on a free localhost port, in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server(engine):
    scheduler = Scheduler()
    with serve_app(make_app(lambda: engine, scheduler)) as url:
        yield {"url": url, "scheduler": scheduler}


# ---- the DevTools protocol over a pipe ---------------------------------------------------------------
class Chromium:
    """Headless Chromium driven over `--remote-debugging-pipe` (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1100):
        self.profile = tempfile.mkdtemp(prefix="strata-chromium-")
        held = []  # occupy any free fd <= 4 so that the pipes (and Popen's own) land above 4
        while (fd := os.open(os.devnull, os.O_RDONLY)) <= 4:
            held.append(fd)
        os.close(fd)
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def remap():  # in the child, before exec: the pipe ends become fds 3 and 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=remap, pass_fds=(3, 4), close_fds=True)
        for fd in (to_chrome_r, from_chrome_w, *held):
            os.close(fd)
        self._ids = iter(range(1, 1 << 30))
        self._replies: dict[int, dict] = {}
        self._cv = threading.Condition()
        self.events: list[dict] = []
        self._stderr: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()
        self.session = None

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cv:
                    self._cv.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cv:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._cv.notify_all()

    def send(self, method: str, params: dict | None = None, session: bool = True, timeout: float = 20) -> dict:
        msg_id = next(self._ids)
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cv:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"no reply to {method} from Chromium: {b''.join(self._stderr)[-2000:]!r}")
                self._cv.wait(left)
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, url: str, width: int = 1400, height: int = 1100) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.send("Runtime.enable")
        self.send("Page.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": url})

    def eval(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"page exception: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError as e:  # e.g. the document is still loading
                value, error = None, e
            else:
                error = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or expression}; last error: {error}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"])
        path.write_bytes(data)
        return data

    def page_errors(self) -> list:
        with self._cv:
            return [e for e in self.events
                    if e.get("method") == "Runtime.exceptionThrown"
                    or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") == "error")]

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser():
    chrome = Chromium(needs_chromium())
    yield chrome
    chrome.close()


# ---- PNG check (stdlib only) --------------------------------------------------------------------------
def png_summary(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct colours among sampled pixels) of an 8-bit RGB/RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), f"unexpected PNG format {depth}/{ctype}"
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours = set()
    for y in range(height):  # undo the per-row filters, sample every 7th pixel
        f, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = row[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if f == 1:
                row[i] = (row[i] + a) & 255
            elif f == 2:
                row[i] = (row[i] + b) & 255
            elif f == 3:
                row[i] = (row[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 7 == 0:
            colours.update(bytes(row[x:x + 3]) for x in range(0, stride, 7 * bpp))
        prev = row
    return width, height, len(colours)


# ---- the residency grid and the routes --------------------------------------------------------------------
def test_residency_grid_matches_the_tier_manager(engine, monkeypatch):
    manager = engine.tiers
    grid = residency_grid(manager)
    json.dumps(grid)  # JSON-ready
    assert grid["layers"] == [1, 2] and grid["experts"] == 16 and grid["tiers"] == list(TIERS)
    assert [len(row) for row in grid["tier"]] == [16, 16]
    flat = [(layer, e, grid["tier"][r][e]) for r, layer in enumerate(grid["layers"]) for e in range(16)]
    with manager._lock:
        pinned = {k for k in manager.pinned.slot_of if k not in manager.pinned.inflight}
    for layer, e, t in flat:
        if (layer, e) in pinned:
            assert TIERS[t] == "pinned"
        elif manager.tmpfs is not None and manager.tmpfs.has(layer):
            assert TIERS[t] == "tmpfs"
        else:
            assert TIERS[t] == "disk"
    assert sum(1 for *_, t in flat if TIERS[t] == "pinned") == len(pinned) > 0
    assert sum(grid["layer_lookups"]) == engine.stats()["tiers"]["lookups"] > 0
    if not hasattr(manager.stats_, "expert_lookups"):
        assert grid["traffic"] is None
        # the counter the lead adds to TierStats: lookups per (layer, expert)
        monkeypatch.setattr(manager.stats_, "expert_lookups", defaultdict(int, {(1, 3): 5, (2, 15): 2}), raising=False)
        grid = residency_grid(manager)
        assert grid["traffic"][0][3] == 5 and grid["traffic"][1][15] == 2 and sum(map(sum, grid["traffic"])) == 7
    else:
        assert sum(map(sum, grid["traffic"])) == engine.stats()["tiers"]["lookups"]


def test_routes_loading_memory_and_static_files(engine):
    state = {"engine": None}
    client = TestClient(make_app(lambda: state["engine"]))
    r = client.get("/v1/strata/residency")
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    for src in ("dashboard/static/dashboard.js", "dashboard/static/dashboard_engram.js", "dashboard/static/dashboard.css"):
        assert src in page.text
        assert client.get("/" + src).status_code == 200
    assert "http://" not in page.text and "https://" not in page.text  # nothing from the network
    js = client.get("/dashboard/static/dashboard.js").text
    assert "v1/strata/stats" in js and "v1/strata/residency" in js
    assert "http://" not in js and "https://" not in js
    assert 'id="engram-panel"' in page.text and 'id="engram-chart"' in page.text
    ejs = client.get("/dashboard/static/dashboard_engram.js").text
    assert "engram-panel" in ejs and "strataDashboardPlugins" in js and "strataDashboardPlugins" in ejs
    assert "http://" not in ejs and "https://" not in ejs
    # the fields of `engram` the panel reads are in the engine's stats
    for key in ("tier", "lookups", "hits", "bytes_read", "stall_s", "cache_rows", "cache_resident", "cache_evictions",
                "table_bytes"):
        assert key in engine.stats()["engram"] and key in ejs
    assert client.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    assert client.get("/dashboard/static/nope.js").status_code == 404

    state["engine"] = engine
    grid = client.get("/v1/strata/residency").json()
    assert grid["experts_mode"] == "tiered" and grid["experts"] == 16

    class MemoryEngine:
        tiers = None

    state["engine"] = MemoryEngine()
    grid = client.get("/v1/strata/residency").json()
    assert grid["experts_mode"] == "memory" and grid["tier"] == []


# ---- the page in real Chromium ------------------------------------------------------------------------------
READ_PAGE = """(() => {
  const t = (id) => { const e = document.getElementById(id); return e ? e.textContent.trim() : null; };
  const v = (id) => { const e = document.getElementById(id); return e && e.dataset.value !== undefined ? Number(e.dataset.value) : null; };
  const lit = (id) => {  // non-background pixels actually painted on a canvas
    const c = document.getElementById(id), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;
  };
  const ids = ['tok-s', 'running', 'waiting', 'requests', 'gen-tokens', 'prompt-tokens', 'lookups',
               'hit-gpu', 'hit-pinned', 'hit-tmpfs', 'hit-disk', 'prefetch-precision',
               'count-pinned', 'count-tmpfs', 'count-disk'];
  return {
    polls: Number(document.body.dataset.polls), gridPolls: Number(document.body.dataset.gridPolls),
    state: document.body.dataset.state,
    text: Object.fromEntries(ids.map((id) => [id, t(id)])),
    value: Object.fromEntries(ids.map((id) => [id, v(id)])),
    cells: Number(document.getElementById('heatmap').dataset.cells),
    heatmapPixels: lit('heatmap'), hitPixels: lit('hit-chart'), tokPixels: lit('tok-chart'),
    hitPoints: Number(document.getElementById('hit-chart').dataset.points),
    reqPoints: Number(document.getElementById('req-chart').dataset.points),
    paths: [...document.querySelectorAll('#paths tbody tr[data-path]')].map((r) => r.dataset.path),
    tiers: [...document.querySelectorAll('#tier-table tbody tr')].map((r) => r.dataset.tier),
    engram: {
      hidden: document.getElementById('engram-panel').hidden, tier: document.body.dataset.engram,
      value: Object.fromEntries(['engram-lookups', 'engram-bytes', 'engram-stall', 'engram-cache', 'engram-hit-cache',
                                 'engram-hit-disk', 'engram-hit-pinned'].map((id) => [id, v(id)])),
      hitText: t('engram-hit-pinned'), chartPixels: lit('engram-chart'),
      points: Number(document.getElementById('engram-chart').dataset.points),
    },
  };
})()"""


def test_dashboard_live_in_chromium(server, engine, browser, tmp_path):
    scheduler = server["scheduler"]
    browser.open(server["url"] + "/dashboard")
    browser.wait_for("Number(document.body.dataset.polls) >= 2 && Number(document.body.dataset.gridPolls) >= 2",
                     what="two polls of the stats and the residency grid")
    first = browser.eval(READ_PAGE)
    stats = engine.stats()
    tiers = stats["tiers"]
    assert first["state"] == "live", first
    # the numbers on the page are the engine's
    assert first["value"]["gen-tokens"] == stats["generated_tokens"] > 0
    assert first["value"]["requests"] == stats["requests"]
    assert first["value"]["tok-s"] == pytest.approx(stats["decode_tokens_per_s"], rel=1e-6)
    assert first["value"]["lookups"] == tiers["lookups"] > 0
    assert first["value"]["running"] == 1 and first["text"]["running"] == "1"
    for tier in ("pinned", "disk"):
        assert first["value"][f"hit-{tier}"] == pytest.approx(tiers["hit_rate"].get(tier, 0.0))
        assert first["text"][f"hit-{tier}"].endswith("%")
    assert first["text"]["hit-gpu"] == "—"  # no GPU tier on this host
    assert first["text"]["tok-s"] not in ("—", "0.0")
    # charts and heatmap are drawn
    assert first["cells"] == 32 and first["heatmapPixels"] > 1000, first
    assert first["hitPixels"] > 0 and first["reqPoints"] >= 2
    # idle since the page opened: the 10 s window has no lookups yet, "since start" has a point per poll
    points = browser.eval("(() => { const s = document.getElementById('hit-window'); s.value = '0';"
                          " s.dispatchEvent(new Event('change'));"
                          " return Number(document.getElementById('hit-chart').dataset.points); })()")
    assert points >= 2 * len(tiers["hit_rate"])
    browser.eval("(() => { const s = document.getElementById('hit-window'); s.value = '10';"
                 " s.dispatchEvent(new Event('change')); })()")
    assert first["tokPixels"] > 0
    assert first["value"]["count-pinned"] + first["value"]["count-tmpfs"] + first["value"]["count-disk"] == 32
    assert "disk->pinned" in first["paths"]
    assert set(first["tiers"]) == set(tiers["tiers"])
    # the Engram panel: rows served by the row cache and the disk, as the engine counts them
    engram, eg = stats["engram"], first["engram"]
    served = sum(engram["hits"].values())
    assert not eg["hidden"] and eg["tier"] == "disk", eg
    assert eg["value"]["engram-lookups"] == engram["lookups"] > 0
    assert eg["value"]["engram-bytes"] == engram["bytes_read"] > 0
    assert eg["value"]["engram-stall"] == pytest.approx(engram["stall_s"])
    assert eg["value"]["engram-cache"] == engram["cache_resident"] > 0
    for tier in ("cache", "disk"):
        assert eg["value"][f"engram-hit-{tier}"] == pytest.approx(engram["hits"].get(tier, 0) / served)
    assert eg["value"]["engram-hit-pinned"] is None and eg["hitText"] == "—"  # not a tier of these tables
    assert eg["chartPixels"] > 0

    # live: more tokens and more running requests show up on the next polls
    engine.generate("Once upon a time", max_tokens=40, temperature=0.8, seed=3)
    scheduler.running, scheduler.waiting = 3, 2
    target = engine.stats()["generated_tokens"]
    browser.wait_for(f"Number(document.getElementById('gen-tokens').dataset.value) === {target} && "
                     "document.getElementById('running').textContent === '3'", what="the next poll")
    second = browser.eval(READ_PAGE)
    assert second["polls"] > first["polls"]
    assert second["value"]["gen-tokens"] == target > first["value"]["gen-tokens"]
    assert second["value"]["requests"] == first["value"]["requests"] + 1
    assert second["value"]["lookups"] > first["value"]["lookups"]
    assert second["value"]["tok-s"] != first["value"]["tok-s"]
    assert second["value"]["waiting"] == 2
    assert second["hitPoints"] > 0  # the lookups of the new request, in the 10 s window
    assert second["value"]["tok-s"] == pytest.approx(engine.stats()["decode_tokens_per_s"], rel=1e-6)
    assert second["engram"]["value"]["engram-lookups"] == engine.stats()["engram"]["lookups"] > \
        first["engram"]["value"]["engram-lookups"]
    # the new request's rows, in the 10 s window (this failed once in CI, not reproduced since: the message says
    # what the page had, (t, rows served) of its last samples and any error its render logged)
    assert second["engram"]["points"] > 0, (second["engram"], browser.page_errors(), browser.eval(
        "JSON.stringify(window.strataDashboard.samples.slice(-12).map((s) => [s.t, s.engram && s.engram.served]))"))

    shot = tmp_path / "dashboard.png"
    data = browser.screenshot(shot)
    width, height, colours = png_summary(data)
    assert width >= 1000 and height >= 600 and colours > 20 and len(data) > 20_000, (width, height, colours, len(data))
    if os.environ.get("STRATA_DASHBOARD_SCREENSHOT"):  # keep a copy to look at
        shutil.copyfile(shot, os.environ["STRATA_DASHBOARD_SCREENSHOT"])
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

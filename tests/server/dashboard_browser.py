"""Headless Chromium for the dashboard's tests: a real uvicorn server in a thread, the DevTools protocol over a
pipe (`--remote-debugging-pipe`: no extra Python packages, no TCP debugging port), and screenshot checks.

The browser tests skip only when no Chromium is installed; `scripts/install-browser.sh` installs one.
"""

from __future__ import annotations

import base64
import contextlib
import io
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
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

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

    def wait_for(self, expression: str, timeout: float = 20.0, what: str = "", dump: str | None = None):
        """Poll `expression` until it is truthy; past `timeout` seconds fail, with `dump` (an expression: what
        the page had) and any page errors in the message."""
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
                had = None
                if dump is not None:
                    try:
                        had = self.eval(dump)
                    except RuntimeError as e:
                        had = f"(dump failed: {e})"
                raise AssertionError(f"timed out after {timeout} s waiting for {what or expression}; last error: "
                                     f"{error}; the page had: {had}; page errors: {self.page_errors()}")
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


# ---- pixels of a screenshot ----------------------------------------------------------------------------
def hex_rgb(color: str) -> tuple[int, int, int]:
    """(r, g, b) of a CSS colour given as #rrggbb."""
    color = color.strip().lstrip("#")
    assert len(color) == 6, f"not a #rrggbb colour: {color!r}"
    return int(color[0:2], 16), int(color[2:4], 16), int(color[4:6], 16)


def region_pixels(png: bytes, box: tuple[float, float, float, float]):
    """The RGB pixels of `box` (left, top, width, height in screenshot pixels) of a PNG: an int array [H, W, 3]."""
    import numpy as np
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    left, top, width, height = (round(v) for v in box)
    return np.asarray(image.crop((left, top, left + width, top + height)), dtype=np.int32)


def colour_matches(pixels, colours: list[tuple[int, int, int]], tolerance: float = 12.0) -> dict:
    """Pixels within `tolerance` (RGB distance) of any of `colours`: {"count", "columns" (distinct x), "x0", "x1"}."""
    import numpy as np

    hit = np.zeros(pixels.shape[:2], dtype=bool)
    for c in colours:
        hit |= np.sqrt(((pixels - np.asarray(c)) ** 2).sum(axis=-1)) <= tolerance
    xs = np.nonzero(hit.any(axis=0))[0]
    return {"count": int(hit.sum()), "columns": len(xs), "x0": int(xs[0]) if len(xs) else None,
            "x1": int(xs[-1]) if len(xs) else None}

"""The tmpfs tier: whole layer files of the store mirrored into /dev/shm (or another tmpfs).

A mirror survives process restarts, so a restarted server reads RAM instead of the disk. Layers are
copied in the background, hottest first, until the budget is used; a layer counts as mirrored only
once its file is complete (copied to a temporary name, then renamed). A marker file records the
store's fingerprint, so a mirror of another store (or another version) is replaced, never used.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

from strata.tiers.store.store import ExpertStore

Key = tuple[int, int]


class TmpfsMirror:
    """Mirror of some layer files of `store` under `root`, within `budget` bytes."""

    def __init__(self, store: ExpertStore, root: str | os.PathLike, budget: int, order: list[Key] | None = None):
        self.store, self.budget = store, budget
        self.root = Path(root).expanduser() / store.index.source_fingerprint[:16]
        self._ready: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._experts: dict[int, list[int]] = {}
        for layer, expert in store.keys():
            self._experts.setdefault(layer, []).append(expert)
        layers = _layer_order(store, order or [])
        self._planned = self._fit(layers)
        self._thread = threading.Thread(target=self._copy_all, name="strata-tmpfs", daemon=True)
        self._thread.start()

    @property
    def copying(self) -> bool:
        """True while the background mirror is still copying layer files into tmpfs."""
        return self._thread.is_alive()

    def _fit(self, layers: list[int]) -> list[int]:
        planned, used = [], 0
        for layer in layers:
            size = self._source(layer).stat().st_size
            if used + size <= self.budget:
                planned.append(layer)
                used += size
        return planned

    def _source(self, layer: int) -> Path:
        path, _, _ = self.store.location((layer, self._experts[layer][0]))
        return Path(path)

    def _copy_all(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / "mirror.json"
        identity = {"fingerprint": self.store.index.source_fingerprint, "slot_bytes": self.store.slot_bytes}
        if not marker.exists() or json.loads(marker.read_text()) != identity:
            for f in self.root.glob("*.bin"):
                f.unlink()
            marker.write_text(json.dumps(identity))
        for layer in self._planned:
            if self._stop.is_set():
                return
            src = self._source(layer)
            dst = self.root / src.name
            if not dst.exists() or dst.stat().st_size != src.stat().st_size:
                tmp = dst.with_suffix(".partial")
                try:
                    shutil.copyfile(src, tmp)
                    os.replace(tmp, dst)
                except OSError:  # tmpfs full: stop mirroring, the disk still serves everything
                    tmp.unlink(missing_ok=True)
                    return
            with self._lock:
                self._ready.add(layer)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the planned layers are mirrored (for tests and start-up reports)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def has(self, layer: int) -> bool:
        with self._lock:
            return layer in self._ready

    def location(self, key: Key) -> tuple[Path, int, int]:
        path, offset, length = self.store.location(key)
        return self.root / Path(path).name, offset, length

    def resident_objects(self) -> int:
        with self._lock:
            return sum(len(self._experts[layer]) for layer in self._ready)

    def capacity_objects(self) -> int:
        return sum(len(self._experts[layer]) for layer in self._planned)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _layer_order(store: ExpertStore, hot: list[Key]) -> list[int]:
    """Layers in order of first appearance in the hot list, then the rest by index."""
    seen: list[int] = []
    for layer, _ in hot:
        if layer not in seen:
            seen.append(layer)
    return seen + sorted({k[0] for k in store.keys()} - set(seen))

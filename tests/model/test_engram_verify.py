"""The Engram verification record: the full checksum pass runs once per table file, not per start;
damage, truncation and stale tmpfs copies are still caught; a read-only store still starts."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import strata.tiers.store.store as store_mod
from strata import Engine
from strata.errors import CheckpointError
from strata.tiers.rows.store import EngramRowStore
from strata.tiers.store.store import ExpertStore
from strata.tiers.store.verify_record import RECORD_NAME, FileIdentity

NO_SCRUB = {"tiers": {"disk": {"scrub": False}}}


@pytest.fixture(scope="module")
def built_store(tiny_model_dir) -> Path:
    with Engine.from_pretrained(tiny_model_dir, config=NO_SCRUB, device="cpu") as e:
        return Path(e.checkpoint.directory)


@pytest.fixture
def store(built_store, tmp_path) -> Path:
    """A private copy of the tiny store, its record included (a copy has new inodes: not vouched for)."""
    shutil.copytree(built_store, tmp_path / "store")
    return tmp_path / "store"


def _open(store_dir: Path, tier: str, tmpfs: Path | None = None, opened: ExpertStore | None = None,
          keep: bool = False) -> EngramRowStore:
    """A row store over the store's Engram tables (started as an engine would); closed unless `keep`."""
    st = opened or ExpertStore.open(store_dir)
    layers = sorted(int(name.split(".")[1]) for name in st.index.tables if name.startswith("engram."))
    rows = EngramRowStore(st, layers, tier, torch.device("cpu"), row_cache=16, read_batch=5,
                          tmpfs_dir=str(tmpfs or store_dir.parent / "shm"))
    if not keep:
        rows.close()
    return rows


def _chunks(rows: EngramRowStore) -> int:
    return sum(t.num_chunks for t in rows.tables.values())


def _names(rows: EngramRowStore) -> set[str]:
    return {t.name for t in rows.tables.values()}


def _served_equal_store(rows: EngramRowStore) -> None:
    """Rows served through the row store equal the store's own checksum-verified read of them."""
    for layer, t in rows.tables.items():
        ids = torch.tensor([[0, t.num_rows - 1], [t.num_rows // 2, 7]])
        got = rows.wait(rows.start(layer, ids)).reshape(-1, rows.dim)
        want = rows.store.rows_view(t.name, rows.store.read_rows(t.name, ids.reshape(-1))).reshape(-1, rows.dim)
        assert torch.equal(got, want)
    rows.close()


def _flip(path: Path, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _tick_past(path: Path) -> None:
    """Wait until the file system's clock has moved past `path`'s ctime (coarse timestamps), so a
    write now gives it a new ctime: probe writes, not sleeps."""
    probe, then = path.parent / ".tick-probe", FileIdentity.of(path).ctime_ns
    while True:
        probe.write_bytes(b"x")
        if FileIdentity.of(probe).ctime_ns > then:
            probe.unlink()
            return


@pytest.mark.parametrize("tier", ["disk", "pinned"])
def test_second_start_skips_the_full_pass(store, tier, monkeypatch):
    sums = [0]
    real = store_mod.checksum
    monkeypatch.setattr(store_mod, "checksum", lambda data: (sums.__setitem__(0, sums[0] + 1), real(data))[1])
    first = _open(store, tier)  # the copied record names other inodes: a full pass
    assert first.verified_from_record == set() and first.chunks_read == _chunks(first) and sums[0] == _chunks(first)
    record = json.loads((store / RECORD_NAME).read_text())["tables"]
    assert set(record) >= _names(first)
    sums[0] = 0
    second = _open(store, tier, keep=True)
    assert second.verified_from_record == _names(second)
    assert sums[0] == 0  # no chunk checksummed
    if tier == "disk":
        assert second.chunks_read == 0  # nothing read at all
        _served_equal_store(second)
    else:  # pinned holds the table: read once, not checksummed
        second.close()
        assert second.chunks_read == _chunks(second)
        for layer in first.full:
            assert torch.equal(first.full[layer], second.full[layer])


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_damage_after_the_record_is_caught(store, keep_mtime):
    _open(store, "disk")
    assert _open(store, "disk").verified_from_record  # the record holds
    table = store / "tables" / "engram.1.bin"
    st = table.stat()
    _tick_past(table)
    _flip(table)
    if keep_mtime:  # setting mtime back leaves ctime moved: still not the recorded file
        os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert table.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(CheckpointError, match=r"engram\.1"):
        _open(store, "disk")


@pytest.mark.parametrize("damage", ["truncate", "truncate_padding", "missing"])
def test_truncated_or_missing_table_is_caught_with_a_record(store, damage):
    _open(store, "disk")
    opened = ExpertStore.open(store)  # opened before the damage: the row store's own check must catch it
    table = store / "tables" / "engram.1.bin"
    if damage == "truncate":
        os.truncate(table, table.stat().st_size - 4096)
    elif damage == "truncate_padding":  # one byte of the alignment padding: every row still reads
        t = opened.index.tables["engram.1"]
        assert table.stat().st_size > t.offset + t.nbytes, "the tiny table is expected to end in padding"
        os.truncate(table, table.stat().st_size - 1)
    else:
        table.unlink()
    with pytest.raises(CheckpointError, match=r"engram\.1"):
        _open(store, "disk", opened=opened)


def test_tmpfs_copy_reused_and_replaced_when_stale(store, tmp_path):
    shm = tmp_path / "shm"
    first = _open(store, "tmpfs", shm)
    assert first.tmpfs_reused == set() and first.chunks_read == _chunks(first)
    copies = {layer: Path(p) for layer, p in first.paths.items()}
    inodes = {layer: p.stat().st_ino for layer, p in copies.items()}

    second = _open(store, "tmpfs", shm, keep=True)  # source and copy both as recorded: nothing read, nothing copied
    assert second.tmpfs_reused == _names(second) and second.chunks_read == 0
    assert {layer: Path(p).stat().st_ino for layer, p in second.paths.items()} == inodes
    _served_equal_store(second)

    layer, copy = next(iter(copies.items()))
    for stale in ("flip", "truncate", "unrecorded"):
        if stale == "flip":
            _tick_past(copy)
            _flip(copy, at=8)
        elif stale == "truncate":  # a partial copy
            os.truncate(copy, copy.stat().st_size // 2)
        else:  # a complete-looking copy the record does not vouch for (e.g. a crash before the record)
            (shm / RECORD_NAME).unlink()
        Path(str(copy) + ".tmp").write_bytes(b"leftover of a crashed copy")
        again = _open(store, "tmpfs", shm, keep=True)
        assert again.tmpfs_reused == set(), stale
        assert again.verified_from_record == _names(again)  # the source is trusted: copied, not re-checksummed
        t = again.tables[layer]
        assert copy.read_bytes() == (store / t.file).read_bytes()[t.offset : t.offset + t.nbytes]
        assert not Path(str(copy) + ".tmp").exists()
        _served_equal_store(again)
        assert _open(store, "tmpfs", shm).tmpfs_reused == _names(again)  # the fresh copy is recorded

    _tick_past(store / "tables" / "engram.1.bin")
    _flip(store / "tables" / "engram.1.bin")  # a damaged store stops start-up even with a good copy
    with pytest.raises(CheckpointError, match=r"engram\.1"):
        _open(store, "tmpfs", shm)


def test_unreadable_record_means_a_full_pass(store):
    (store / RECORD_NAME).write_text("{not json")
    rows = _open(store, "disk")
    assert rows.verified_from_record == set() and rows.chunks_read == _chunks(rows)
    assert _open(store, "disk").verified_from_record == _names(rows)  # rewritten


def test_read_only_store_dir_verifies_every_start(store, tiny_model_dir, monkeypatch):
    (store / RECORD_NAME).unlink()
    real_open = os.open

    def no_create(path, flags, *args, **kwargs):  # root ignores the mode bits: refuse creation as EACCES would
        if flags & os.O_CREAT and Path(path).parent == store:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_create)
    store.chmod(0o555)
    try:
        conf = {"engram": {"tier": "disk"}, **NO_SCRUB}
        for _ in range(2):
            with Engine.from_pretrained(store, config=conf, device="cpu") as eng:
                rows = eng.model.engram.source
                assert rows.verified_from_record == set() and rows.chunks_read == _chunks(rows)
                assert eng.generate([5, 6, 7, 8], max_tokens=2).token_ids
        assert not (store / RECORD_NAME).exists()
        assert not any(p.name.startswith(f".{RECORD_NAME}.tmp") for p in store.iterdir())
    finally:
        store.chmod(0o755)

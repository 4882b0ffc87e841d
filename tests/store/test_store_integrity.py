"""A store's integrity as it is served: dense tensors checked at load (once per file version), damaged experts
listed once however often they are asked for, `strata verify`'s progress, and a tmpfs path that cannot be one."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from strata import Engine
from strata.errors import CheckpointError
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.model.engram.store import drop_tables
from strata.runtime.model.loader import load_model
from strata.runtime.plan import host as host_mod
from strata.runtime.plan.checkpoints.convert import cmd_verify, convert_checkpoint
from strata.runtime.plan.host import HostInfo, probe_host
from strata.runtime.plan.planner import PlanError, plan
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store import store as store_mod
from strata.tiers.store.dense_check import DENSE_RECORD
from strata.tiers.store.format import layer_file
from strata.tiers.store.safetensors_index import TensorIndex
from strata.tiers.store.store import ExpertStore
from strata.tiers.store.verify_record import RECORD_NAME, FileIdentity

NO_SCRUB = {"tiers": {"disk": {"scrub": False}}}
GiB = 1 << 30


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory) -> Path:
    return convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("integrity") / "store", progress=False)


@pytest.fixture
def store(built, tmp_path) -> Path:
    """A private copy of the tiny store (no verification record: a copy has other inodes anyway)."""
    return Path(shutil.copytree(built, tmp_path / "store"))


def _flip_bit(store: Path, tensor: str) -> None:
    """Flip one bit of `tensor` in dense.safetensors, after the clock has moved past the file's ctime."""
    path = store / "dense.safetensors"
    then = FileIdentity.of(path).ctime_ns
    probe = store / ".tick"
    while probe.write_bytes(b"x") and FileIdentity.of(probe).ctime_ns <= then:
        pass
    probe.unlink()
    info = TensorIndex.from_dir(store)[tensor]
    with open(path, "r+b") as f:
        f.seek(info.offset + info.nbytes // 2)
        b = f.read(1)
        f.seek(info.offset + info.nbytes // 2)
        f.write(bytes([b[0] ^ 0x01]))


def _load(store: Path) -> Checkpoint:
    """Load the store's model as a tiered engine does (Engram tables stay in the store)."""
    ckpt = Checkpoint.open(store)
    load_model(ckpt, torch.float32, "cpu", prepare=drop_tables)
    return ckpt


@pytest.mark.parametrize("tensor", ["lm_head.weight", "model.norm.weight"])
def test_a_damaged_dense_tensor_stops_the_load_naming_it(store, tensor):
    _flip_bit(store, tensor)
    with pytest.raises(CheckpointError, match=rf"dense\.safetensors: tensor '{tensor}' is damaged.*strata verify"):
        Engine.from_pretrained(store, config={**NO_SCRUB, "runtime": {"cpu_numerics": "gpu"}}, device="cpu")


def test_dense_tensors_are_hashed_once_per_file_version(store):
    first = _load(store)
    assert first.dense_check.hashed == len(first.store.index.dense.tensor_checksums)  # all, used or not
    record = json.loads((store / RECORD_NAME).read_text())["tables"]
    assert DENSE_RECORD in record
    assert _load(store).dense_check.hashed == 0  # unchanged since: trusted
    _flip_bit(store, "lm_head.weight")  # a write moves the file's identity: checked again, and caught
    with pytest.raises(CheckpointError, match="'lm_head.weight' is damaged"):
        _load(store)


def test_a_damaged_header_stops_the_load(store):
    path = store / "dense.safetensors"
    data = bytearray(path.read_bytes())
    at = data.index(b'"format":"pt"') + len('"format":"p')
    data[at] = ord("u")  # still a valid header, but not the one the index has the checksum of
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"dense\.safetensors: its header is damaged"):
        _load(store)


def test_a_damaged_expert_is_listed_once(store):
    s = ExpertStore.open(store)
    path, offset, _ = s.location((2, 3))
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        b = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    m = TierManager(s, TierBudgets(gpu_slots=0, pinned_slots=8), policy="lru", io_threads=2)
    try:
        for _ in range(4):
            with pytest.raises(CheckpointError, match=r"layer 2, expert 3"):
                m.acquire([(2, 3)], "cpu")
        assert m.scrub().result(timeout=60) == [(2, 3)]
        stats = m.stats()
        assert stats["damaged"] == [[2, 3]] and stats["checksum_failures"] == 5  # every failed read still counted
    finally:
        m.close()
        s.close()


class _Bar(store_mod.tqdm):
    """A silent progress bar that remembers where it ended."""

    ended: list[tuple[int, int]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": False, "file": open("/dev/null", "w")})  # noqa: SIM115

    def close(self) -> None:
        if not self.disable:  # tqdm closes again when collected, disabled by then
            _Bar.ended.append((self.n, self.total))
        super().close()


@pytest.mark.parametrize("damage", ["none", "header", "missing layer file"])
def test_verify_progress_reaches_the_end(store, damage, monkeypatch):
    monkeypatch.setattr(store_mod, "tqdm", _Bar)
    _Bar.ended.clear()
    if damage == "header":
        with open(store / "dense.safetensors", "r+b") as f:
            f.seek(9)
            f.write(b"#")
    elif damage == "missing layer file":
        (store / layer_file(2)).unlink()
    assert cmd_verify(argparse.Namespace(store=str(store))) == (0 if damage == "none" else 2)
    (n, total), = _Bar.ended
    assert total > 0 and n == total


# ---- tiers.tmpfs.path ---------------------------------------------------------------------------------


def test_a_tmpfs_path_that_is_no_tmpfs_says_so(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setattr(host_mod, "_fs_type", lambda path: "ext4")
    missing, plain = tmp_path / "no" / "ram", tmp_path
    assert probe_host(str(missing), str(tmp_path)).tmpfs_problem == f"tiers.tmpfs.path {missing} does not exist"
    assert probe_host(str(plain), str(tmp_path)).tmpfs_problem == f"tiers.tmpfs.path {plain} is not a tmpfs mount (it is on ext4)"
    host = HostInfo(ram_total=64 * GiB, ram_available=64 * GiB, tmpfs_path=str(plain),
                    tmpfs_problem=f"tiers.tmpfs.path {plain} is not a tmpfs mount", disk_free=GiB, cpu_count=4)
    with pytest.raises(PlanError, match=r"is not a tmpfs mount; use a tmpfs path such as /dev/shm or set "
                                        r"tiers.tmpfs.budget = 0"):
        plan(tiny_model_dir, host, {"tiers": {"tmpfs": {"budget": "1GiB"}}})
    with pytest.raises(PlanError, match=r'is not a tmpfs mount; use a tmpfs path such as /dev/shm or set engram.tier = "disk"'):
        plan(tiny_model_dir, host, {"engram": {"tier": "tmpfs"}})  # the tiny model has Engram tables
    assert plan(tiny_model_dir, host, {}).tier("tmpfs").bytes == 0  # no tmpfs asked for: nothing to say
    monkeypatch.setattr(host_mod, "_fs_type", lambda path: "tmpfs")
    assert probe_host(str(missing), str(tmp_path)).tmpfs_problem == ""  # created on first use

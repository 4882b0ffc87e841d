"""Stores built on first use: keyed by the weights' fingerprint, their copies of the small files following the
checkpoint, never left keyed after a failed build, and planned where they are (or will be) written."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from strata import Engine
from strata.config import load_config
from strata.errors import CheckpointError
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.plan import planner as planner_mod
from strata.runtime.plan.checkpoints import convert as convert_mod
from strata.runtime.plan.checkpoints.convert import cmd_verify, convert_checkpoint
from strata.runtime.plan.checkpoints.store_cache import ensure_store, store_dir_for, store_root
from strata.runtime.plan.host import HostInfo
from strata.runtime.plan.planner import PlanError, cmd_plan
from strata.server.serve import preflight_plan
from strata.tiers.store.format import (
    INDEX_NAME,
    checkpoint_fingerprint,
    earlier_fingerprint,
    is_store,
    layer_file,
    read_index,
)
from strata.tiers.store.store import ExpertStore

NO_SCRUB = {"tiers": {"disk": {"scrub": False}}}
GiB = 1 << 30


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private $STRATA_CACHE: stores built here are this test's alone."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def src(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "tiny"))


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def test_the_store_follows_the_checkpoints_small_files(src, cache):
    """A checkpoint first loaded without tokenizer.json and later with it (and a new template, generation
    config and config.json) keeps its store, whose copies are brought up to date at load."""
    tokenizer = (src / "tokenizer.json").read_bytes()
    (src / "tokenizer.json").unlink()
    cfg = load_config(NO_SCRUB)
    store = ensure_store(src, cfg, progress=False)
    assert store.parent == cache / "stores" and not (store / "tokenizer.json").exists()
    layer = store / layer_file(1)
    before = (layer.stat().st_ino, layer.stat().st_mtime_ns)

    (src / "tokenizer.json").write_bytes(tokenizer)
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (src / "generation_config.json").unlink()
    _edit_json(src / "config.json", rms_norm_eps=1e-5)
    assert ensure_store(src, cfg, progress=False) == store  # the same weights: the same store, not rebuilt
    assert (layer.stat().st_ino, layer.stat().st_mtime_ns) == before
    for name in ("tokenizer.json", "chat_template.jinja", "config.json"):
        assert (store / name).read_bytes() == (src / name).read_bytes(), name
    assert not (store / "generation_config.json").exists()
    assert set(read_index(store).copied_files) == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                                   "chat_template.jinja"}
    assert ExpertStore.open(store).verify() == []  # the index records the new copies' checksums
    assert Checkpoint.open(store).config.rms_norm_eps == 1e-5
    index_mtime = (store / INDEX_NAME).stat().st_mtime_ns
    ensure_store(src, cfg, progress=False)  # nothing changed: nothing written
    assert (store / INDEX_NAME).stat().st_mtime_ns == index_mtime


def test_a_config_that_does_not_describe_the_weights_is_named(src, cache):
    store = ensure_store(src, load_config(NO_SCRUB), progress=False)
    _edit_json(src / "config.json", first_k_dense_replace=2)  # layer 1 dense now: the experts say otherwise
    ensure_store(src, load_config(NO_SCRUB), progress=False)
    with pytest.raises(CheckpointError, match=r"config\.json: MoE layers \[2\].*the store holds MoE layers \[1, 2\]"):
        Checkpoint.open(store)


def test_other_weights_get_another_store(src, cache):
    cfg = load_config(NO_SCRUB)
    first = ensure_store(src, cfg, progress=False)
    save_file({"extra.weight": torch.ones(2)}, src / "extra.safetensors")
    second = ensure_store(src, cfg, progress=False)
    assert second != first and is_store(first) and is_store(second)
    assert read_index(second).source_fingerprint == checkpoint_fingerprint(src)


def test_weights_of_the_same_shape_get_another_store(src, tmp_path, cache):
    """Two checkpoints alike in every header (another seed, a fine-tune) but not in their weights: each loads
    its own store and generates its own tokens (headers alone would give both the first one's store)."""
    from strata.runtime.demo.model import write_demo_model

    other = write_demo_model(tmp_path / "other" / src.name, size="tiny", seed=1)
    assert all((other / f.name).read_bytes()[:64] == f.read_bytes()[:64] for f in src.glob("*.safetensors"))
    assert checkpoint_fingerprint(other) != checkpoint_fingerprint(src)
    cfg = load_config(NO_SCRUB)
    assert ensure_store(other, cfg, progress=False) != ensure_store(src, cfg, progress=False)
    outputs = []
    for path in (src, other):
        with Engine.from_pretrained(path, config={**NO_SCRUB, "runtime": {"cpu_numerics": "gpu"}}, device="cpu") as e:
            outputs.append(e.generate([5, 6, 7, 8], max_tokens=8).token_ids)
    assert outputs[0] != outputs[1]


def test_a_store_left_without_its_index_is_rebuilt_not_used(src, cache):
    """A directory at the store's place with its data but no index (a store copied in part, an index lost)
    is neither loaded as a checkpoint nor in the way: the next load converts again."""
    cfg = load_config(NO_SCRUB)
    store = ensure_store(src, cfg, progress=False)
    (store / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"this store has no index \(store\.msgpack\); re-run `strata convert`"):
        Checkpoint.open(store)
    with pytest.raises(CheckpointError, match="this store has no index"):
        Engine.from_pretrained(store, config=NO_SCRUB, device="cpu")
    with pytest.raises(CheckpointError, match="this store has no index"):
        cmd_verify(argparse.Namespace(store=str(store)))
    assert ensure_store(src, cfg, progress=False) == store and ExpertStore.open(store, src).verify() == []
    assert not list(store.parent.glob(".*"))  # the old files went with the directory moved aside


def test_a_store_finished_meanwhile_is_not_replaced(src, tmp_path, monkeypatch):
    """Two converts replacing the same index-less directory: the one that finishes second keeps the first's
    store (a server may already read it) and drops its own."""
    out = convert_checkpoint(src, tmp_path / "store", progress=False)
    (out / INDEX_NAME).unlink()
    real, inner = convert_mod.StoreWriter.write_layer, []

    def another_convert_finishes_first(self, *args, **kwargs):
        if not inner:
            inner.append("started")  # the inner convert writes through this same method
            convert_checkpoint(src, out, progress=False)
            inner.append((out / layer_file(1)).stat().st_ino)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(convert_mod.StoreWriter, "write_layer", another_convert_finishes_first)
    assert convert_checkpoint(src, out, progress=False) == out
    assert (out / layer_file(1)).stat().st_ino == inner[1] and ExpertStore.open(out, src).verify() == []
    assert not list(out.parent.glob(".store.tmp-*"))


def test_weights_that_change_while_converted_leave_no_store(src, cache, monkeypatch):
    real, calls = convert_mod.StoreWriter.write_layer, []

    def write_then_replace_weights(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # another process is still writing the checkpoint's files
            save_file({"extra.weight": torch.ones(2)}, src / "extra.safetensors")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(convert_mod.StoreWriter, "write_layer", write_then_replace_weights)
    with pytest.raises(CheckpointError, match="changed while they were read"):
        ensure_store(src, load_config(NO_SCRUB), progress=False)
    assert not (cache / "stores").exists() or not any((cache / "stores").iterdir())


def test_a_refused_plan_builds_no_store(src, cache):
    """The plan comes first: a model that does not fit converts nothing."""
    with pytest.raises(PlanError, match="tiers.pinned.budget"):
        Engine.from_pretrained(src, config={"tiers": {"pinned": {"budget": "900TiB"}}}, device="cpu")
    assert not (cache / "stores").exists() or not any((cache / "stores").iterdir())


def test_a_store_an_earlier_strata_built_is_taken_over(src, cache):
    """A store that an earlier strata keyed by config.json and the weights' headers holds the same weights: it is
    renamed into place."""
    cfg = load_config(NO_SCRUB)
    earlier = store_root(cfg) / f"{src.name}-{earlier_fingerprint(src)[:12]}"
    convert_checkpoint(src, earlier, progress=False)
    raw = read_index(earlier)
    raw.source_fingerprint = earlier_fingerprint(src)
    (earlier / INDEX_NAME).write_bytes(raw.to_bytes())
    inode = (earlier / layer_file(1)).stat().st_ino
    store = ensure_store(src, cfg, progress=False)
    assert store != earlier and not earlier.exists() and (store / layer_file(1)).stat().st_ino == inode
    assert read_index(store).source_fingerprint == checkpoint_fingerprint(src)
    ExpertStore.open(store, src).close()


# ---- planning where the store is ------------------------------------------------------------------


def _host(disk_free: int) -> HostInfo:
    return HostInfo(ram_total=64 * GiB, ram_available=64 * GiB, tmpfs_path="/dev/shm/strata", tmpfs_free=GiB,
                    disk_path="", disk_free=disk_free, cpu_count=4)


def test_plan_measures_and_reports_the_store_under_strata_cache(src, cache, monkeypatch, capsys):
    probed = []

    def probe(tmpfs: str, disk: str) -> HostInfo:
        probed.append(disk)
        return _host(disk_free=0)  # no room: only an existing store may be planned

    monkeypatch.setattr(planner_mod, "probe_host", probe)
    cfg = load_config(NO_SCRUB)
    args = argparse.Namespace(model=str(src), gpu_mem=None, ram=None, config=None, json=False)
    assert cmd_plan(args) == 1  # the layout is printed, the store that does not fit listed below it
    shown = capsys.readouterr().out
    assert "tier" in shown and "does not fit: the expert store" in shown and f"built in {cache / 'stores'}" in shown
    assert Path(probed[-1]).parent == cache / "stores"  # the disk measured is $STRATA_CACHE's
    store = ensure_store(src, cfg, progress=False)
    assert store_dir_for(src, cfg) == store and probed[-1] == str(store)
    assert cmd_plan(args) == 0
    assert f"existing at {store}" in capsys.readouterr().out
    the_plan = preflight_plan(src, cfg)  # strata serve's preflight: the same place
    assert the_plan.store_exists and the_plan.store_dir == str(store) and probed[-1] == str(store)


def test_plan_of_a_store_directory_says_where_it_is(src, tmp_path, monkeypatch, capsys):
    store = convert_checkpoint(src, tmp_path / "store", progress=False)
    monkeypatch.setattr(planner_mod, "probe_host", lambda tmpfs, disk: _host(disk_free=0))
    assert store_dir_for(store, load_config(None)) == store
    assert cmd_plan(argparse.Namespace(model=str(store), gpu_mem=None, ram=None, config=None, json=False)) == 0
    assert f"existing at {store}" in capsys.readouterr().out


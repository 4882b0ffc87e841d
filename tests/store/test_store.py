"""The tiered expert store: convert, read back bit-exactly, detect damage, staleness, atomicity, tables."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from argparse import Namespace
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from reference_models import build_reference
from strata.errors import CheckpointError, ConfigError, StrataError
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.plan.checkpoints import convert as convert_mod
from strata.runtime.plan.checkpoints.convert import cmd_convert, cmd_verify, convert_checkpoint
from strata.tiers.store import writer as store_writer
from strata.tiers.store.format import ALIGN, INDEX_NAME, StoreIndex, checkpoint_fingerprint, is_store, layer_file
from strata.tiers.store.safetensors_index import TensorIndex
from strata.tiers.store.store import ExpertStore, StaleStoreError
from strata.tiers.store.writer import add_table


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparison (NaN-safe, dtype-agnostic)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def tmp_siblings(store: Path) -> list[Path]:
    return list(store.parent.glob(f".{store.name}.tmp-*"))


@pytest.fixture(scope="module")
def sources(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The demo model (DeepSeek-V3, per-expert, bf16) and transformers-built checkpoints (fp32)."""
    root = tmp_path_factory.mktemp("refs")
    out = {"demo": tiny_model_dir}
    for arch, fused in [("qwen3_moe", True), ("mixtral", False), ("deepseek_v3", True)]:
        name = f"{arch}-{'fused' if fused else 'per-expert'}"
        out[name] = build_reference(arch, root / name, fused=fused)[1]
    return out


@pytest.fixture(scope="module")
def demo_store(tiny_model_dir, tmp_path_factory) -> Path:
    return convert_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("stores") / "demo", progress=False)


@pytest.fixture
def damaged_copy(demo_store, tmp_path) -> Path:
    """A private copy of the demo store that a test may damage."""
    return Path(shutil.copytree(demo_store, tmp_path / "copy"))


@pytest.mark.parametrize("name", ["demo", "qwen3_moe-fused", "mixtral-per-expert", "deepseek_v3-fused"])
def test_store_matches_checkpoint_bit_exactly(sources, tmp_path, name):
    src = sources[name]
    store_dir = convert_checkpoint(src, tmp_path / "store", progress=False)
    ckpt = Checkpoint.open(src)
    store = ExpertStore.open(store_dir, src)
    cfg = ckpt.config
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    moe = [layer for layer, m in enumerate(cfg.moe_layers) if m]
    assert store.index.moe_layers == moe and store.dtype == ckpt.dtype
    assert store.expert_shapes == ((2 * i, h), (h, i))
    assert list(store.keys()) == [(layer, e) for layer in moe for e in range(cfg.num_experts)]
    assert store.slot_bytes % ALIGN == 0 and store.payload_bytes == 3 * i * h * ckpt.dtype.itemsize
    for layer in moe:
        gate_up, down = ckpt.load_experts(layer, ckpt.dtype, "cpu")  # [E, 2I, H], [E, H, I]
        for e in range(cfg.num_experts):
            path, offset, length = store.location((layer, e))
            assert offset % ALIGN == 0 and length == store.slot_bytes
            assert path == store_dir / layer_file(layer) and offset == e * store.slot_bytes
            buf = store.read_expert((layer, e))
            gu, dn = store.expert_views(buf)
            assert gu.data_ptr() == buf.data_ptr()  # views, no copy
            assert torch.equal(bits(gu), bits(gate_up[e])) and torch.equal(bits(dn), bits(down[e]))
            assert not buf[store.payload_bytes :].any()  # zero padding
        stacked = store.load_layer_experts(layer, ckpt.dtype, "cpu")
        assert torch.equal(bits(stacked[0]), bits(gate_up)) and torch.equal(bits(stacked[1]), bits(down))
        assert (store_dir / layer_file(layer)).stat().st_size == cfg.num_experts * store.slot_bytes
    # dense.safetensors: every non-expert tensor, same names, same bytes; readable by TensorIndex
    dense = TensorIndex.from_dir(store_dir)
    want = [n for n in ckpt.index.names() if not re.search(r"\.(mlp|block_sparse_moe)\.experts\.", n)]
    tables = [n for n in want if n.endswith(".engram.multi_head_embedding.embedding.weight")]  # Engram: table objects
    want = [n for n in want if n not in tables]
    assert sorted(dense.names()) == sorted(want)
    for n in tables:  # each Engram table is a row-addressable object with the checkpoint's bytes
        rows = ckpt.index[n].shape[0]
        got = store.rows_view(f"engram.{n.split('.')[2]}", store.read_rows(f"engram.{n.split('.')[2]}", range(rows)))
        assert torch.equal(bits(got), bits(ckpt.index.load(n)))
    for n in want:
        assert dense[n].offset % ckpt.index.load(n).element_size() == 0
        assert dense[n].dtype == ckpt.index[n].dtype and dense[n].shape == ckpt.index[n].shape
        assert torch.equal(bits(dense.load(n)), bits(ckpt.index.load(n)))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (store_dir / f).read_bytes() == (src / f).read_bytes()
    assert store.verify() == []
    st = pytest.importorskip("safetensors.torch")  # the real library accepts dense.safetensors
    assert sorted(st.load_file(store_dir / "dense.safetensors")) == sorted(want)


def test_store_on_tmpfs(tiny_model_dir):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="strata-test-"))
    try:
        store = ExpertStore.open(convert_checkpoint(tiny_model_dir, root / "store", progress=False), tiny_model_dir)
        key = store.keys()[-1]
        out = torch.empty(store.slot_bytes, dtype=torch.uint8)
        assert store.read_expert(key, out=out) is out
        assert store.verify() == []
        store.close()
    finally:
        shutil.rmtree(root)


def test_flipped_byte_in_blob_is_detected(damaged_copy, capsys):
    store = ExpertStore.open(damaged_copy)
    path, offset, _ = store.location((2, 5))
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        b = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match=r"layer-002\.bin.*\(layer 2, expert 5\)"):
        store.read_expert((2, 5))
    store.read_expert((2, 5), verify=False)  # opting out reads it anyway
    store.read_expert((2, 4))  # its neighbours are intact
    assert store.verify() == ["experts/layer-002.bin (layer 2, expert 5)"]
    assert cmd_verify(Namespace(store=str(damaged_copy))) == 2
    out = capsys.readouterr().out
    assert "damaged: experts/layer-002.bin (layer 2, expert 5)" in out and out.count("damaged:") == 1


def test_verify_sound_store(demo_store, capsys):
    assert cmd_verify(Namespace(store=str(demo_store))) == 0
    assert "sound" in capsys.readouterr().out


def test_damaged_dense_and_copied_files_are_named(damaged_copy):
    store = ExpertStore.open(damaged_copy)
    info = TensorIndex.from_dir(damaged_copy)["model.norm.weight"]
    with open(damaged_copy / "dense.safetensors", "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff")
    (damaged_copy / "tokenizer.json").write_text("{}")
    assert store.verify() == ["dense.safetensors: tensor 'model.norm.weight'", "tokenizer.json: checksum mismatch"]


def test_truncated_layer_file(damaged_copy):
    path = damaged_copy / layer_file(1)
    size = path.stat().st_size
    os.truncate(path, size - 100)
    with pytest.raises(CheckpointError, match=r"layer-001\.bin: .*truncated"):
        ExpertStore.open(damaged_copy)
    damaged = ExpertStore(damaged_copy, _index(damaged_copy)).verify()  # open() refuses; verify reports
    last = max(e for layer, e in _index(damaged_copy).blobs if layer == 1)
    assert damaged == [f"experts/layer-001.bin: {size - 100} bytes, expected {size}",
                       f"experts/layer-001.bin (layer 1, expert {last})"]  # fmt: skip
    assert cmd_verify(Namespace(store=str(damaged_copy))) == 2


def _index(directory: Path) -> StoreIndex:
    return StoreIndex.from_bytes((directory / INDEX_NAME).read_bytes())


def test_missing_file_and_corrupt_index(damaged_copy):
    (damaged_copy / layer_file(2)).unlink()
    with pytest.raises(CheckpointError, match=r"layer-002\.bin: missing"):
        ExpertStore.open(damaged_copy)
    raw = msgpack.unpackb((damaged_copy / INDEX_NAME).read_bytes())
    (damaged_copy / INDEX_NAME).write_bytes(msgpack.packb({**raw, "version": 99}))
    with pytest.raises(CheckpointError, match="store format version 99, this strata reads versions 1 and 2"):
        ExpertStore.open(damaged_copy)
    (damaged_copy / INDEX_NAME).write_bytes(msgpack.packb({**raw, "slot_bytes": 4096}))
    with pytest.raises(CheckpointError, match="slot_bytes 4096 is wrong"):
        ExpertStore.open(damaged_copy)
    (damaged_copy / INDEX_NAME).write_bytes(b"\x93garbage")
    with pytest.raises(CheckpointError, match="store.msgpack: not a valid strata store index"):
        ExpertStore.open(damaged_copy)
    with pytest.raises(CheckpointError, match="not a strata store"):
        ExpertStore.open(damaged_copy / "experts")


def test_stale_store(tiny_model_dir, tmp_path):
    src = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    assert checkpoint_fingerprint(src) == checkpoint_fingerprint(tiny_model_dir)  # a copy is the same checkpoint
    store_dir = convert_checkpoint(src, tmp_path / "store", progress=False)
    ExpertStore.open(store_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (src / "config.json").write_text(json.dumps(cfg))
    ExpertStore.open(store_dir, src)  # the fingerprint is the weights': the store's config.json follows the source
    save_file({"extra.weight": torch.ones(2)}, src / "extra.safetensors")  # other weights: another store
    with pytest.raises(StaleStoreError, match="stale store.*strata convert"):
        ExpertStore.open(store_dir, src)
    with pytest.raises(StaleStoreError, match="different checkpoint"):
        convert_checkpoint(src, store_dir, progress=False)


def test_reconvert_same_store_is_a_no_op(demo_store, tiny_model_dir, capsys):
    files = [demo_store / INDEX_NAME, demo_store / layer_file(1), demo_store / "dense.safetensors"]
    before = [f.stat().st_mtime_ns for f in files]
    assert convert_checkpoint(tiny_model_dir, demo_store, progress=False) == demo_store
    assert cmd_convert(Namespace(model=str(tiny_model_dir), store=str(demo_store))) == 0
    assert "already the store" in capsys.readouterr().out
    assert [f.stat().st_mtime_ns for f in files] == before


def test_refuses_other_directories(tiny_model_dir, demo_store, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty and is not a strata store"):
        convert_checkpoint(tiny_model_dir, tmp_path / "busy", progress=False)
    with pytest.raises(ConfigError, match="already a strata store"):
        convert_checkpoint(demo_store, tmp_path / "again", progress=False)
    (tmp_path / "empty").mkdir()  # an empty directory is fine
    assert is_store(convert_checkpoint(tiny_model_dir, tmp_path / "empty", progress=False))


def test_interrupted_convert_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    real, calls = convert_mod.StoreWriter.write_layer, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(convert_mod.StoreWriter, "write_layer", failing)
    store = tmp_path / "store"
    with pytest.raises(RuntimeError, match="injected"):
        convert_checkpoint(tiny_model_dir, store, progress=False)
    assert not store.exists() and tmp_siblings(store) == []


def test_full_disk_is_one_line_error(tiny_model_dir, tmp_path, monkeypatch):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_writer, "pwrite_all", no_space)  # where the store's bytes are written
    store = tmp_path / "store"
    with pytest.raises(StrataError, match="no space left on the device") as err:
        convert_checkpoint(tiny_model_dir, store, progress=False)
    assert "\n" not in str(err.value)
    assert not store.exists() and tmp_siblings(store) == []


def test_unreadable_source_is_one_line_error(tiny_model_dir, tmp_path, monkeypatch):
    src = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    shard = src / "model.safetensors"
    real_plan = convert_mod._plan

    def plan_then_truncate(*args):  # the shard is cut after it was indexed: reads hit its end
        out = real_plan(*args)
        os.truncate(shard, shard.stat().st_size // 2)
        return out

    monkeypatch.setattr(convert_mod, "_plan", plan_then_truncate)
    with pytest.raises(CheckpointError, match="unexpected end of file") as err:
        convert_checkpoint(src, tmp_path / "store", progress=False)
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "store").exists() and tmp_siblings(tmp_path / "store") == []


def test_convert_is_deterministic(tiny_model_dir, demo_store, tmp_path):
    again = convert_checkpoint(tiny_model_dir, tmp_path / "again", progress=False)
    files = sorted(p.relative_to(demo_store) for p in demo_store.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (demo_store / f).read_bytes() == (again / f).read_bytes(), f
    index = _index(demo_store)
    assert StoreIndex.from_bytes(index.to_bytes()) == index


def test_tables(damaged_copy):
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (10_000, 64), dtype=torch.uint8, generator=g)
    entry = add_table(damaged_copy, "engram", rows)
    assert entry.num_rows == 10_000 and entry.row_bytes == 64 and entry.num_chunks == 3 and entry.offset % ALIGN == 0
    # the same rows streamed in uneven pieces give the same checksums
    typed = rows.view(torch.float32)  # [10000, 16] float32 rows
    streamed = add_table(damaged_copy, "engram_f32", (typed[a:b] for a, b in [(0, 1), (1, 5000), (5000, 10_000)]))
    assert streamed.chunk_checksums == entry.chunk_checksums and streamed.row_shape == (16,)
    with pytest.raises(ConfigError, match="already has a table"):
        add_table(damaged_copy, "engram", rows)

    store = ExpertStore.open(damaged_copy)
    for _ in range(5):
        ids = torch.randint(0, 10_000, (257,), generator=g)
        assert torch.equal(store.read_rows("engram", ids), rows[ids])
        assert torch.equal(store.read_rows("engram", ids.tolist(), verify=False), rows[ids])
    assert torch.equal(store.read_rows("engram", [7, 5000, 9999]), rows[[7, 5000, 9999]])  # one pread a row
    ids = [9_999, 0, 4096, 4095, 0]
    got = store.read_rows("engram_f32", ids)
    assert torch.equal(store.rows_view("engram_f32", got), typed[ids])
    assert store.read_rows("engram", []).shape == (0, 64)
    with pytest.raises(IndexError):
        store.read_rows("engram", [10_000])

    # corrupt one row of the second chunk: a fresh store detects it, other chunks still read
    t = store.index.tables["engram"]
    with open(damaged_copy / t.file, "r+b") as f:
        f.seek(t.offset + 5000 * 64 + 3)
        f.write(bytes([rows[5000, 3].item() ^ 0xFF]))
    fresh = ExpertStore.open(damaged_copy)
    with pytest.raises(CheckpointError, match=r"table 'engram', rows 4096-8191"):
        fresh.read_rows("engram", [5001])
    assert torch.equal(fresh.read_rows("engram", [1, 9000]), rows[[1, 9000]])
    assert fresh.verify() == ["tables/engram.bin (table 'engram', rows 4096-8191)"]


def test_keys_are_sorted_once(tiny_model_dir, tmp_path):
    """A decode step asks for the store's keys (via `all_resident`): they are made once, not sorted per call."""
    store = ExpertStore.open(convert_checkpoint(tiny_model_dir, tmp_path / "store", progress=False))
    try:
        assert store.keys() is store.keys() and list(store.keys()) == sorted(store.index.blobs)
    finally:
        store.close()

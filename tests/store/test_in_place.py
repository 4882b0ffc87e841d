"""Serving a checkpoint from its own safetensors files (the in-place store) against the packed store and every expert
in memory, on the tiny reference checkpoints of every architecture in both expert layouts; FP8 in place; damage
caught at the first read of the damaged part; a changed file refused."""

from __future__ import annotations

import os

import pytest
import torch

from reference_models import ARCHS, VOCAB, build_reference
from strata import Engine
from strata.errors import CheckpointError
from strata.tiers.store.in_place import InPlaceStore

FP32 = {"dtype": "float32", "cpu_numerics": "gpu", "max_context": 128}
PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()


def tiered(path, mode: str, pinned: str = "16KiB", **store) -> Engine:
    """An engine whose experts outside a small pinned budget are read from disk at every use."""
    cfg = {"runtime": FP32, "store": {"mode": mode, **store},
           "tiers": {"pinned": {"budget": pinned}, "disk": {"scrub": False}}}
    return Engine.from_pretrained(path, device="cpu", config=cfg)


def scores_and_tokens(engine: Engine) -> tuple[torch.Tensor, list[int]]:
    return engine.score(PROMPT), engine.generate(PROMPT, max_tokens=6, temperature=0.0).token_ids


CASES = [(a, f) for a in ARCHS for f in (False, True)]


@pytest.mark.parametrize("arch, fused", CASES, ids=[f"{a}-{'fused' if f else 'per-expert'}" for a, f in CASES])
def test_in_place_matches_packed_and_memory(arch, fused, tmp_path):
    _, ckpt = build_reference(arch, tmp_path / "ckpt", fused=fused)
    memory = Engine.from_pretrained(ckpt, device="cpu", config={"runtime": {**FP32, "experts": "memory"}})
    want_scores, want_tokens = scores_and_tokens(memory)
    with tiered(ckpt, "packed") as packed:
        assert not isinstance(packed.tiers.store, InPlaceStore)
        packed_scores, packed_tokens = scores_and_tokens(packed)
    with tiered(ckpt, "auto") as in_place:
        store = in_place.tiers.store
        assert isinstance(store, InPlaceStore) and store.source == ckpt.resolve()
        scores, tokens = scores_and_tokens(in_place)
        assert in_place.stats()["tiers"]["tiers"]["pinned"]["evictions"] > 0  # experts came back from the files
        # nothing but the index and the checksums in the cache
        names = {p.name for p in store.directory.iterdir()}
        assert "in-place.msgpack" in names and names <= {"in-place.msgpack", "in-place-verified.msgpack"}
    assert torch.equal(scores, packed_scores)  # the same bytes in the same slots: bit-identical
    assert tokens == packed_tokens == want_tokens
    assert (scores - want_scores).abs().max().item() < 1e-5


def test_fp8_checkpoint_in_place(tmp_path):
    from quantized_models import quantize_checkpoint

    _, plain = build_reference("qwen3_moe", tmp_path / "ref")
    fp8 = quantize_checkpoint(plain, tmp_path / "fp8", "fp8", (16, 16))
    with tiered(fp8, "packed") as packed:
        want = scores_and_tokens(packed)
    with tiered(fp8, "in_place") as in_place:
        assert isinstance(in_place.tiers.store, InPlaceStore)
        assert in_place.tiers.store.expert_format.kind == "fp8"
        got = scores_and_tokens(in_place)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def _first_part(store: InPlaceStore, key=None):
    key = key or store.keys()[0]
    return key, store.index.experts[key][0]


def _flip_keeping_identity(path, offset: int) -> None:
    """Change one byte the way bit rot does: the file's size, mtime and inode stay as they were."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_verification_pass_then_damage_caught_at_first_read(tmp_path):
    _, ckpt = build_reference("mixtral", tmp_path / "ckpt")
    with tiered(ckpt, "in_place") as engine:
        store = engine.tiers.store
        store.start_verification().join()  # the full pass: every part's checksum recorded
        done, total = store.verification_progress()
        assert done == total > 0 and store.pass_damaged == []
        key, part = _first_part(store, store.keys()[-1])
        directory = store.directory
    _flip_keeping_identity(ckpt / part.file, part.offset + part.length // 2)
    reopened = InPlaceStore.open(directory)  # unchanged identity: opens without reading the weights
    reopened.read_expert(store.keys()[0])  # an undamaged part reads fine
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in bytes {part.offset}\.\..*expert {key[1]}"):
        reopened.read_expert(key)
    assert any("checksum mismatch" in d for d in reopened.verify())


def test_file_gone_after_opening_named_with_the_fix(tmp_path):
    _, ckpt = build_reference("qwen3_moe", tmp_path / "ckpt")
    with tiered(ckpt, "in_place") as engine:
        directory = engine.tiers.store.directory
    with InPlaceStore.open(directory) as store:  # its files are opened at their first read
        key, part = _first_part(store)
        (ckpt / part.file).rename(tmp_path / "moved.safetensors")  # gone once the store is open (an unmounted disk)
        with pytest.raises(CheckpointError, match=rf"{part.file}: cannot open: .*restore the checkpoint's file"):
            store.read_expert(key)


def test_changed_file_refused_or_reverified(tmp_path):
    _, ckpt = build_reference("qwen3_moe", tmp_path / "ckpt")
    with tiered(ckpt, "in_place") as engine:
        engine.tiers.store.start_verification().join()
        _, part = _first_part(engine.tiers.store)
    path = ckpt / part.file
    with open(path, "r+b") as f:  # rewritten in place: its mtime moves
        f.seek(part.offset)
        f.write(f.read(1))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match=rf"{path.name}: changed since strata indexed it.*reverify = true"):
        tiered(ckpt, "in_place")
    with tiered(ckpt, "in_place", reverify=True) as engine:  # verified again instead
        store = engine.tiers.store
        assert store.verification_progress()[0] < store.verification_progress()[1]
        assert engine.generate(PROMPT, max_tokens=2, temperature=0.0).token_ids


def test_strata_verify_of_a_checkpoint_served_in_place(tmp_path, capsys):
    """`strata verify CHECKPOINT_DIR` re-reads every part of a checkpoint served in place against its recorded
    checksums: 0 and "sound" while intact; 2 naming the damaged part after bit rot (identity unchanged)."""
    from strata.cli import main

    _, ckpt = build_reference("qwen3_moe", tmp_path / "ckpt")
    with tiered(ckpt, "in_place") as engine:
        key, part = _first_part(engine.tiers.store, engine.tiers.store.keys()[-1])
    assert main(["verify", str(ckpt)]) == 0  # records every checksum on the way
    assert "sound (read in place" in capsys.readouterr().out
    _flip_keeping_identity(ckpt / part.file, part.offset + part.length // 2)
    assert main(["verify", str(ckpt)]) == 2
    out = capsys.readouterr()
    assert f"experts.{key[1]}." in out.out and "checksum mismatch" in out.out and "re-download" in out.err


def test_closing_the_engine_stops_the_verification_pass_where_it_is(tmp_path, monkeypatch):
    """The background pass of an in-place store stops when the engine closes (not reading the rest of a checkpoint
    for nobody); what it recorded is kept, and a later pass finishes the rest."""
    import time

    import strata.tiers.store.in_place as in_place

    _, ckpt = build_reference("qwen3_moe", tmp_path / "ckpt")
    real = in_place.checksum

    def slow_checksum(data):
        time.sleep(0.02)  # a part of a real checkpoint takes about this long to read
        return real(data)

    monkeypatch.setattr(in_place, "checksum", slow_checksum)
    engine = tiered(ckpt, "in_place")
    store = engine.tiers.store
    verifier = store.start_verification()
    time.sleep(0.1)
    engine.close()
    assert not verifier.is_alive()
    done, total = store.verification_progress()
    assert 0 < done < total
    monkeypatch.setattr(in_place, "checksum", real)
    with InPlaceStore.open(store.directory) as reopened:
        assert reopened.verify() == [] and reopened.verification_progress() == (total, total)

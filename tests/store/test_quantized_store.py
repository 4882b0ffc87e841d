"""Stores that keep experts quantized: a checkpoint's FP8 / MXFP4 experts copied bit for bit into the blob layout,
a bf16 checkpoint's quantized while packing, the format recorded and checked (`strata verify`), every tier and
policy serving the quantized blobs, and a one-line error for each bad scale tensor."""

from __future__ import annotations

import os
import shutil
from argparse import Namespace
from pathlib import Path

import msgpack
import pytest
import torch
from quantized_models import quantize_checkpoint, set_tensor
from safetensors import safe_open
from safetensors.torch import save_file

from reference_models import build_reference
from strata import Engine
from strata.errors import CheckpointError, ConfigError
from strata.kernels.experts import moe_forward
from strata.kernels.gpu.experts.quant_slots import QuantSlotWeights
from strata.kernels.quant import ExpertFormat, ExpertLayout
from strata.runtime.model.checkpoint import Checkpoint
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.tiered_moe import TieredExperts
from strata.runtime.plan.checkpoints.convert import cmd_convert, cmd_verify, convert_checkpoint
from strata.tiers.manager import TierBudgets, TierManager
from strata.tiers.store.format import INDEX_NAME, checksum, read_index
from strata.tiers.store.store import ExpertStore

SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """qwen3_moe reference checkpoints: per-expert FP8 (16 x 16 blocks), fused MXFP4, and the fused fp32 one."""
    root = tmp_path_factory.mktemp("quantized")
    _, per_expert = build_reference("qwen3_moe", root / "per-expert")
    _, fused = build_reference("qwen3_moe", root / "fused", fused=True)
    return {"fp8": quantize_checkpoint(per_expert, root / "fp8", "fp8"),
            "mxfp4": quantize_checkpoint(fused, root / "mxfp4", "mxfp4"), "plain": fused}


@pytest.fixture(scope="module")
def stores(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized-stores")
    return {name: convert_checkpoint(checkpoints[name], root / name, progress=False) for name in ("fp8", "mxfp4")}


def _tensor(directory: Path, name: str) -> torch.Tensor:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return f.get_tensor(name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_the_store_keeps_the_checkpoints_experts_bit_for_bit(checkpoints, stores, name, capsys):
    src, store = checkpoints[name], ExpertStore.open(stores[name], checkpoints[name])
    idx = store.index
    want = ExpertFormat("fp8", block=(16, 16)) if name == "fp8" else ExpertFormat("mxfp4")
    assert idx.version == 2 and idx.expert_format == want and read_index(stores[name]).expert_format == want
    layout = ExpertLayout.build(want, idx.hidden, idx.moe_intermediate)
    assert store.payload_bytes == layout.payload_bytes and store.slot_bytes % 4096 == 0
    weights = 3 * idx.hidden * idx.moe_intermediate
    assert store.payload_bytes < (2 * weights if name == "fp8" else weights)  # under bf16's bytes (a byte's)
    assert store.dtype == torch.uint8 and idx.dtype == "U8"  # no dtype to view the blob as
    with pytest.raises(TypeError, match="expert_matrices"):
        store.expert_views(store.read_expert((0, 0)))
    for layer, e in [(0, 0), (2, 7)]:
        gate_up, down = store.expert_matrices(store.read_expert((layer, e)))
        if name == "fp8":
            p = f"model.layers.{layer}.mlp.experts.{e}."
            values = torch.cat([_tensor(src, p + f"{w}_proj.weight") for w in ("gate", "up")])
            scales = torch.cat([_tensor(src, p + f"{w}_proj.weight_scale_inv") for w in ("gate", "up")])
            down_values, down_scales = _tensor(src, p + "down_proj.weight"), _tensor(src, p + "down_proj.weight_scale_inv")
        else:
            p = f"model.layers.{layer}.mlp.experts."
            values, scales = _tensor(src, p + "gate_up_proj_blocks")[e], _tensor(src, p + "gate_up_proj_scales")[e]
            down_values, down_scales = _tensor(src, p + "down_proj_blocks")[e], _tensor(src, p + "down_proj_scales")[e]
        assert torch.equal(_bits(gate_up.values), _bits(values)) and torch.equal(_bits(gate_up.scales), _bits(scales))
        assert torch.equal(_bits(down.values), _bits(down_values)) and torch.equal(_bits(down.scales), _bits(down_scales))
    assert cmd_verify(Namespace(store=str(stores[name]))) == 0
    assert f"{len(idx.blobs)} {want.name} experts" in capsys.readouterr().out


@pytest.mark.parametrize("experts", ["fp8", "mxfp4"])
def test_convert_quantizes_a_plain_checkpoint_while_packing(checkpoints, tmp_path, experts, capsys):
    """`strata convert --experts`: each blob is the checkpoint's expert quantized (round to nearest) into the format;
    the engine on the store computes exactly what the fp32 path computes on those dequantized weights."""
    src = checkpoints["plain"]
    assert cmd_convert(Namespace(model=str(src), store=str(tmp_path / "store"), experts=experts, config=None)) == 0
    assert f"{experts} 32x32 experts" in capsys.readouterr().out if experts == "fp8" else True
    store = ExpertStore.open(tmp_path / "store", src)
    fmt = store.expert_format
    assert fmt == (ExpertFormat("fp8", block=(32, 32)) if experts == "fp8" else ExpertFormat("mxfp4"))
    ckpt = Checkpoint.open(src)
    layer = store.index.moe_layers[0]
    gate_up, down = ckpt.load_experts(layer, torch.float32, "cpu")
    for e in (0, 5):
        want = store.layout.pack(gate_up[e], down[e])
        assert torch.equal(store.read_expert((layer, e))[: store.payload_bytes], want)
    with pytest.raises(ConfigError, match="holds the store of .* with .* experts"):  # a store of another format
        convert_checkpoint(src, tmp_path / "store", progress=False)
    # the engine on the store == strata's fp32 path on the dequantized experts
    memory = Engine.from_pretrained(src, device="cpu", config={"runtime": {"dtype": "float32", "experts": "memory"}})
    for layer in store.index.moe_layers:
        deq = store.load_layer_experts(layer, torch.float32, "cpu")
        memory.model.layers[layer].mlp.experts.gate_up_proj.copy_(deq[0])
        memory.model.layers[layer].mlp.experts.down_proj.copy_(deq[1])
    cfg = {"runtime": {"dtype": "float32", "cpu_numerics": "gpu"}, "tiers": {"disk": {"scrub": False}}}
    with Engine.from_pretrained(tmp_path / "store", device="cpu", config=cfg) as tiered:
        ids = list(range(3, 40, 3))
        assert (tiered.score(ids) - memory.score(ids)).abs().max().item() < 1e-5


def test_the_cache_keeps_one_store_per_format(checkpoints, strata_cache):
    """`[store] experts` names the packed store built on first use: the plain and the fp8 store of one checkpoint
    coexist (a plain checkpoint is otherwise served in place, with no store of its own)."""
    src = checkpoints["plain"]
    base = {"runtime": {"dtype": "float32", "cpu_numerics": "gpu"}, "tiers": {"disk": {"scrub": False}}}
    dirs = {}
    for experts in ("checkpoint", "fp8"):
        store = {"experts": experts, "mode": "packed"}
        with Engine.from_pretrained(src, device="cpu", config={**base, "store": store}) as engine:
            dirs[experts] = engine.tiers.store.directory
            assert engine.tiers.store.expert_format.kind == ("plain" if experts == "checkpoint" else "fp8")
    assert dirs["fp8"].name == dirs["checkpoint"].name + "-fp8"


def test_a_damaged_or_malformed_quantized_blob_is_found(stores, tmp_path, capsys):
    d = Path(shutil.copytree(stores["fp8"], tmp_path / "copy"))
    store = ExpertStore.open(d)
    path, offset, _ = store.location((2, 3))
    with open(path, "r+b") as f:  # one bit of gate_up's values
        f.seek(offset + 10)
        b = f.read(1)
        f.seek(offset + 10)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match=r"layer 2, expert 3"):
        store.read_expert((2, 3))
    assert store.verify() == ["experts/layer-002.bin (layer 2, expert 3)"]
    # a blob whose checksum holds over a scale that is no number (a store written wrong): verify names the scales
    buf = store.read_expert((0, 1)).clone()
    scales = store.expert_matrices(buf)[1].scales
    scales[0, 0] = float("nan")
    path, offset, _ = store.location((0, 1))
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(buf[: store.payload_bytes].numpy().tobytes())
    raw = msgpack.unpackb((d / INDEX_NAME).read_bytes())
    for blob in raw["blobs"]:
        if (blob["layer"], blob["expert"]) == (0, 1):
            blob["checksum"] = checksum(buf[: store.payload_bytes].numpy())
    (d / INDEX_NAME).write_bytes(msgpack.packb(raw))
    damaged = ExpertStore.open(d).verify()
    assert "experts/layer-000.bin (layer 0, expert 1): down has fp8 block scales that are not finite and positive" in damaged
    assert cmd_verify(Namespace(store=str(d))) == 2


def test_a_version_1_index_still_loads(stores, tmp_path, tiny_model_dir):
    """Stores written before the index recorded formats (version 1, no expert_format: plain experts) open as before;
    a quantized store's index without its format does not."""
    plain = convert_checkpoint(tiny_model_dir, tmp_path / "plain", progress=False)
    raw = msgpack.unpackb((plain / INDEX_NAME).read_bytes())
    raw.pop("expert_format")
    (plain / INDEX_NAME).write_bytes(msgpack.packb({**raw, "version": 1}))
    store = ExpertStore.open(plain)
    assert store.index.version == 1 and store.expert_format == ExpertFormat("plain", "BF16")
    gate_up, down = store.expert_views(store.read_expert((1, 0)))
    assert gate_up.dtype == torch.bfloat16 and store.verify() == []
    q = Path(shutil.copytree(stores["fp8"], tmp_path / "q"))
    raw = msgpack.unpackb((q / INDEX_NAME).read_bytes())
    raw.pop("expert_format")
    (q / INDEX_NAME).write_bytes(msgpack.packb({**raw, "version": 1}))
    with pytest.raises(CheckpointError, match="not a valid strata store index"):
        ExpertStore.open(q)


@pytest.mark.parametrize("name, policy", [("fp8", "lru"), ("fp8", "lfu"), ("fp8", "static"), ("fp8", "cost"),
                                          ("mxfp4", "lfu")])
def test_quantized_experts_through_every_tier(stores, name, policy):
    """GPU slots (simulated in RAM), pinned RAM, tmpfs and disk serve the blobs as stored; a layer through the GPU
    tier and through the CPU tier equals every expert in memory, dequantized (fp32)."""
    store = ExpertStore.open(stores[name])
    root = SHM / f"strata-test-quantized-{os.getpid()}"
    tmpfs = {"tmpfs_bytes": 1 << 30} if SHM.is_dir() else {}
    layer = store.index.moe_layers[0]
    gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
    # a GPU tier of 3 slots (its pinned staging holds all 16 experts); RAM of 5 slots before tmpfs and disk
    for tier, budgets in (("gpu", TierBudgets(gpu_slots=3, pinned_slots=16)),
                          ("cpu", TierBudgets(pinned_slots=5, **tmpfs))):
        m = TierManager(store, budgets, gpu_device=torch.device("cpu") if tier == "gpu" else None, policy=policy,
                        io_threads=2, tmpfs_dir=root)
        try:
            if tmpfs and tier == "cpu":
                assert m.tmpfs.wait(timeout=30)
            for key in store.keys():  # more experts than the tier holds
                (h,) = m.acquire([key], tier)
                want = store.expert_matrices(store.read_expert(key))
                assert h.quantized and all(torch.equal(a.values.cpu(), b.values) and torch.equal(a.scales.cpu(), b.scales)
                                           for a, b in zip(h.matrices, want, strict=True))
                if key[0] == layer:
                    weights = h.weights(torch.float32)
                    assert torch.equal(weights[0], gu[key[1]]) and torch.equal(weights[1], dn[key[1]])
                with pytest.raises(TypeError, match="weights"):
                    _ = h.gate_up
                m.release([h])
            compute = ExpertCompute(m, tier, "gpu")
            # the decode pair kernels read the format: the GPU tier's slots are handed to them as stored
            assert compute.pairs_read_format and isinstance(compute.slots, QuantSlotWeights) == (tier == "gpu")
            experts = TieredExperts(layer, store.index.num_experts, compute)
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)])
                w, x = torch.rand(5, 2, generator=g), torch.randn(5, store.index.hidden, generator=g)
                assert torch.equal(experts(x, ids, w), moe_forward(x, gu, dn, ids, w))
            stats = m.stats()
            assert stats["tiers"]["gpu" if tier == "gpu" else "pinned"]["evictions"] > 0
            if tmpfs and tier == "cpu":
                assert stats["paths"]["tmpfs->pinned"]["objects"] > 0 and "disk->pinned" not in stats["paths"]
        finally:
            m.close()
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", ["missing", "shape", "mx-missing", "mx-shape"])
def test_bad_scale_tensors_are_one_line_errors_naming_them(checkpoints, tmp_path, case):
    src = checkpoints["mxfp4" if case.startswith("mx") else "fp8"]
    d = Path(shutil.copytree(src, tmp_path / "bad"))
    if case == "missing":
        name = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"
        set_tensor(d, name, None)
        named = "model.layers.2.mlp.experts.3.up_proj.weight"
    elif case == "shape":
        name = named = "model.layers.0.self_attn.q_proj.weight_scale_inv"
        set_tensor(d, name, torch.ones(3, 3))
    elif case == "mx-missing":
        named = "model.layers.0.mlp.experts.down_proj_scales"
        set_tensor(d, named, None)
    else:
        named = "model.layers.2.mlp.experts.gate_up_proj_scales"
        set_tensor(d, named, torch.zeros(8, 64, 1, dtype=torch.uint8))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    msg = str(e.value)
    assert "\n" not in msg and repr(named) in msg
    if case == "missing":
        assert repr(name) in msg


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_quantized_store_on_cuda_matches_memory(checkpoints, stores, name):
    """On a GPU: the tiered engine (GPU slots, pinned RAM, disk) on the quantized store against every expert in
    memory, dequantized, in fp32."""
    memory = Engine.from_pretrained(checkpoints[name], device="cuda",
                                    config={"runtime": {"dtype": "float32", "experts": "memory"}})
    cfg = {"runtime": {"dtype": "float32", "cpu_numerics": "gpu"}, "tiers": {"gpu": {"budget": "64KiB"}}}
    with Engine.from_pretrained(stores[name], device="cuda", config=cfg) as tiered:
        ids = list(range(3, 60, 3))
        assert (tiered.score(ids) - memory.score(ids)).abs().max().item() < 1e-4
        assert tiered.generate(ids, max_tokens=8).token_ids == memory.generate(ids, max_tokens=8).token_ids


def test_bf16_block_scales_are_stored_as_float32(checkpoints, tmp_path):
    """Releases that ship their FP8 scales in bf16: the store converts them (exactly) instead of requantizing."""
    d = Path(shutil.copytree(checkpoints["fp8"], tmp_path / "bf16-scales"))
    with safe_open(d / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    tensors = {n: t.bfloat16() if n.endswith("_scale_inv") else t for n, t in tensors.items()}
    save_file(tensors, d / "model.safetensors")
    store = ExpertStore.open(convert_checkpoint(d, tmp_path / "store", progress=False))
    gate_up, down = store.expert_matrices(store.read_expert((2, 5)))
    p = "model.layers.2.mlp.experts.5."
    assert torch.equal(gate_up.scales, torch.cat([tensors[p + f"{w}_proj.weight_scale_inv"] for w in ("gate", "up")]).float())
    assert torch.equal(_bits(down.values), _bits(tensors[p + "down_proj.weight"]))


def test_the_cli_writes_inspects_converts_and_verifies_a_quantized_demo_model(tmp_path, capsys):
    from strata.cli import main

    d, store = tmp_path / "demo-mxfp4", tmp_path / "store"
    assert main(["demo-model", str(d), "--size", "tiny", "--layers", "2", "--no-engram", "--experts", "mxfp4"]) == 0
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "formats        experts mxfp4: " in out and "fused layout" in out
    assert main(["convert", str(d), str(store)]) == 0 and "mxfp4 experts" in capsys.readouterr().out
    assert read_index(store).expert_format == ExpertFormat("mxfp4")
    assert main(["verify", str(store)]) == 0 and "sound" in capsys.readouterr().out
    assert main(["convert", str(d), str(tmp_path / "again"), "--experts", "fp8"]) == 2  # mxfp4 is not requantized
    assert "already mxfp4" in capsys.readouterr().err


def test_apply_experts_takes_experts_as_stored(stores):
    """The generic fallback: `apply_experts` given (gate_up, down) as stored dequantizes each expert as it runs it."""
    from strata.kernels.experts import apply_experts, group_by_expert

    store = ExpertStore.open(stores["fp8"])
    layer = store.index.moe_layers[0]
    gu, dn = store.load_layer_experts(layer, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4)])
    w, x = torch.rand(4, 2, generator=g), torch.randn(4, store.index.hidden, generator=g)
    blobs = {e: store.read_expert((layer, e)) for e in range(8)}
    got = apply_experts(x, w, 2, group_by_expert(ids, 8), lambda e: store.expert_matrices(blobs[e]))
    assert torch.equal(got, moe_forward(x, gu, dn, ids, w))


def test_a_bad_store_setting_names_the_key():
    from strata.config import load_config

    with pytest.raises(ConfigError, match=r"store\.experts = 'int4' is invalid"):
        load_config({"store": {"experts": "int4"}})

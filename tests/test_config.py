"""config.toml at the repository root is the documented default: it must parse and equal the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.config import StrataConfig, load_config
from strata.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_root_config_is_the_default():
    assert load_config(ROOT / "config.toml") == StrataConfig()


def test_every_key_in_root_config_is_commented():
    lines = (ROOT / "config.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.lstrip().startswith("#"):
            assert lines[i - 1].lstrip().startswith("#"), f"config.toml line {i + 1} has no comment: {line}"


def test_dict_overrides_merge_over_defaults():
    cfg = load_config({"runtime": {"max_context": 128}})
    assert cfg.runtime.max_context == 128 and cfg.runtime.prefill_chunk == StrataConfig().runtime.prefill_chunk


@pytest.mark.parametrize(
    "data, key",
    [({"runtime": {"device": "tpu"}}, "runtime.device"), ({"runtime": {"dtype": "int4"}}, "runtime.dtype"),
     ({"runtime": {"threads": -1}}, "runtime.threads"), ({"runtime": {"max_context": True}}, "max_context"),
     ({"runtimes": {}}, "runtimes"), ({"runtime": 3}, "runtime"),
     ({"debug": {"split_decode": "python"}}, "debug.split_decode"),
     ({"debug": {"grouped_prefill": "yes"}}, "debug.grouped_prefill"),
     ({"debug": {"grouped_prefill": 1}}, "debug.grouped_prefill"),
     ({"debug": {"overlap_decode": "sometimes"}}, "debug.overlap_decode"),
     ({"debug": {"cuda_graphs": 1}}, "debug.cuda_graphs"),
     ({"debug": {"warm_ahead": "yes"}}, "debug.warm_ahead"),
     ({"debug": {"engram_zero_copy": "no"}}, "debug.engram_zero_copy"),
     ({"debug": {"engram_read_batch": 0}}, "debug.engram_read_batch"),
     ({"debug": {"gpu_share": 1.5}}, "debug.gpu_share"), ({"debug": {"gpu_share": True}}, "debug.gpu_share"),
     ({"debug": {"gpu_share": "half"}}, "debug.gpu_share"), ({"debug": {"cpu_threads": -1}}, "debug.cpu_threads"),
     ({"debug": {"cpu_kernel": "avx9000"}}, "debug.cpu_kernel"), ({"debug": {"pdl": 0}}, "debug.pdl"),
     ({"debug": {"fused_kernels": "off"}}, "debug.fused_kernels"), ({"debug": {"verbose": True}}, "debug.verbose")],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(data)


# ------------------------------------------------------------------- tiers, policy, prefetch, planner


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("1.5GB", 1_500_000_000), ("0", 0), ("auto", None), ("AUTO", None), ("512mib", 512 * 2**20),
     ("100", 100), ("2 KB", 2000), ("1.5GiB", 3 * 2**29), ("1TiB", 2**40), ("7B", 7), (4096, 4096), (0, 0)],
)
def test_sizes_parse(text, expected):
    from strata.config import parse_size

    assert parse_size(text, "tiers.gpu.budget") == expected


@pytest.mark.parametrize("text", ["24 gigs", "24G", "-1GiB", "", "GiB", "1.2.3MB", "1e9", "twelve"])
def test_malformed_sizes_name_the_key(text):
    from strata.config import parse_size

    with pytest.raises(ConfigError, match=r'^tiers\.gpu\.budget = ".*" is not a size; use e\.g\. "24GiB"'):
        parse_size(text, "tiers.gpu.budget")


def test_sizes_are_checked_at_load_time():
    with pytest.raises(ConfigError) as e:
        load_config({"tiers": {"gpu": {"budget": "24 gigs"}}})
    assert str(e.value) == 'tiers.gpu.budget = "24 gigs" is not a size; use e.g. "24GiB", "512MiB" or "auto"'
    cfg = load_config({"tiers": {"gpu": {"budget": "1.5GiB"}, "pinned": {"budget": 1 << 30}, "tmpfs": {"budget": "2GB"}},
                       "planner": {"activation_reserve": "512MiB"}})
    assert cfg.tiers.gpu.budget_bytes == 3 * 2**29 and cfg.tiers.pinned.budget_bytes == 2**30
    assert cfg.tiers.tmpfs.budget_bytes == 2 * 10**9 and cfg.planner.activation_reserve_bytes == 2**29
    assert StrataConfig().tiers.gpu.budget_bytes is None and StrataConfig().tiers.tmpfs.budget_bytes == 0


def test_default_sections():
    cfg = StrataConfig()
    assert (cfg.tiers.tmpfs.path, cfg.tiers.disk.path) == ("/dev/shm/strata", "~/.cache/strata")
    assert (cfg.policy.eviction, cfg.policy.lfu_half_life, cfg.policy.budget_scope) == ("lfu", 8192, "global")
    assert (cfg.prefetch.lookahead, cfg.planner.max_batch) == (1, 1)
    assert cfg.planner.activation_reserve_bytes == 2 * 2**30
    assert cfg.to_dict()["tiers"]["gpu"] == {"budget": "auto"} and load_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "data, key",
    [({"policy": {"eviction": "fifo"}}, "policy.eviction"), ({"policy": {"budget_scope": "layer"}}, "policy.budget_scope"),
     ({"policy": {"lfu_half_life": 0}}, "policy.lfu_half_life"), ({"prefetch": {"lookahead": -1}}, "prefetch.lookahead"),
     ({"planner": {"max_batch": 0}}, "planner.max_batch"), ({"planner": {"activation_reserve": "auto"}}, "planner.activation_reserve"),
     ({"tiers": {"tmpfs": {"budget": "auto"}}}, "tiers.tmpfs.budget"), ({"tiers": {"pinned": {"budget": "lots"}}}, "tiers.pinned.budget"),
     ({"tiers": {"gpu": {"budget": True}}}, "tiers.gpu.budget"), ({"tiers": {"gpu": {"budget": -5}}}, "tiers.gpu.budget"),
     ({"tiers": {"gpu": {"size": "1GiB"}}}, "tiers.gpu.size"), ({"tiers": {"nvme": {}}}, "tiers.nvme"),
     ({"tiers": {"disk": {"path": ""}}}, "tiers.disk.path"), ({"tiers": {"disk": {"path": 3}}}, "tiers.disk.path"),
     ({"policy": {"eviction": 1}}, "policy.eviction")],
)
def test_bad_section_values_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(data)
    assert "\n" not in str(e.value)


def test_root_config_documents_every_section():
    import tomllib

    data = tomllib.loads((ROOT / "config.toml").read_text())
    assert set(data) == {"runtime", "tiers", "policy", "prefetch", "planner", "engram", "store", "debug"}
    assert list(data)[-1] == "debug"  # the switches users leave alone come last
    assert set(data["tiers"]) == {"gpu", "pinned", "tmpfs", "disk"}
    assert load_config(data).to_dict() == StrataConfig().to_dict()


# ------------------------------------------------------------------- [debug]


def test_debug_section_takes_its_switches():
    cfg = load_config({"debug": {"cuda_graphs": False, "split_decode": "host", "gpu_share": 0.25, "cpu_threads": 6,
                                 "cpu_kernel": "torch", "overlap_decode": True, "engram_read_batch": 7}})
    d = cfg.debug
    assert (d.cuda_graphs, d.split_decode, d.cpu_threads, d.cpu_kernel, d.overlap_decode) == (False, "host", 6, "torch", True)
    assert d.fixed_gpu_share == 0.25 and d.engram_read_batch == 7 and d.warm_ahead and d.fused_kernels and d.pdl
    assert StrataConfig().debug.fixed_gpu_share is None and load_config({"debug": {"gpu_share": 0}}).debug.fixed_gpu_share == 0.0


@pytest.mark.parametrize(
    "old, new",
    [("runtime.cuda_graphs", "cuda_graphs"), ("runtime.split_decode", "split_decode"), ("runtime.warm_ahead", "warm_ahead"),
     ("runtime.overlap_decode", "overlap_decode"), ("runtime.grouped_prefill", "grouped_prefill"),
     ("engram.prefetch", "engram_prefetch"), ("engram.read_batch", "engram_read_batch"),
     ("engram.zero_copy", "engram_zero_copy"), ("engram.graph_wait", "engram_graph_wait")],
)
def test_a_key_at_its_old_place_says_where_it_moved(old, new):
    section, key = old.split(".")
    with pytest.raises(ConfigError) as e:
        load_config({section: {key: False}})
    assert str(e.value) == f"{old} moved to [debug] {new}; set it there"
    assert hasattr(StrataConfig().debug, new)


@pytest.mark.parametrize("key", ["read_in_place", "copy_ahead"])
def test_a_removed_key_says_it_no_longer_exists(key):
    with pytest.raises(ConfigError, match=rf"^runtime\.{key} no longer exists \(.+\); remove it$") as e:
        load_config({"runtime": {key: True}})
    assert "\n" not in str(e.value)


def test_a_moved_key_in_a_config_file_names_its_place(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[runtime]\ncuda_graphs = false\n")
    with pytest.raises(ConfigError, match=r"runtime\.cuda_graphs moved to \[debug\] cuda_graphs"):
        load_config(path)

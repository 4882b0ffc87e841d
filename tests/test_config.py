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
     ({"runtime": {"split_decode": "python"}}, "runtime.split_decode"),
     ({"runtime": {"grouped_prefill": "yes"}}, "runtime.grouped_prefill"),
     ({"runtime": {"grouped_prefill": 1}}, "runtime.grouped_prefill"),
     ({"runtime": {"cuda_graphs": 1}}, "runtime.cuda_graphs"),
     ({"runtime": {"copy_ahead": "auto"}}, "runtime.copy_ahead"),
     ({"runtime": {"warm_ahead": "yes"}}, "runtime.warm_ahead")],
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
    assert set(data) == {"runtime", "tiers", "policy", "prefetch", "planner", "engram"}
    assert set(data["tiers"]) == {"gpu", "pinned", "tmpfs", "disk"}
    assert load_config(data).to_dict() == StrataConfig().to_dict()

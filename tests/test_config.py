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
     ({"runtimes": {}}, "runtimes"), ({"runtime": 3}, "runtime")],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(data)

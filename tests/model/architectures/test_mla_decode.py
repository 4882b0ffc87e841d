"""MLA decode in the latent space (kv_b_proj absorbed) against the window expanded through kv_b_proj."""

from __future__ import annotations

import pytest
import torch

from reference_models import _configs
from strata.runtime.model.attention import MLAAttention
from strata.runtime.model.config import ModelConfig


def _mla(long: bool) -> MLAAttention:
    cfg = ModelConfig.from_hf(_configs(long)["deepseek_v3"].to_dict())
    torch.manual_seed(0)
    attn = MLAAttention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn


@pytest.mark.parametrize("long", [False, True], ids=["plain", "yarn-scale"])
def test_absorbed_decode_equals_expanded(long):
    """Every head over the same cache window, sequences at different positions (later keys masked): the latent-
    space attention gives the expanded one's output to fp32 rounding, and the masked keys do not matter."""
    attn = _mla(long)
    b, s, nh = 3, 40, attn.num_heads
    g = torch.Generator().manual_seed(1)
    q_nope = torch.randn(b, nh, attn.nope, generator=g)
    q_rot = torch.randn(b, nh, attn.rope_dim, generator=g)
    lat = torch.randn(b, s, attn.kv_lora_rank, generator=g)
    rot = torch.randn(b, s, attn.rope_dim, generator=g)
    pos = torch.tensor([39, 0, 17])
    with torch.no_grad():
        absorbed = attn.attend_absorbed(q_nope, q_rot, lat, rot, pos)
        expanded = attn.attend_expanded(q_nope, q_rot, lat, rot, pos)
        assert absorbed.shape == (b, nh, attn.v_dim)
        torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
        garbage = lat.clone()
        garbage[1, 1:] = 1e3  # past sequence 1's position: masked
        torch.testing.assert_close(attn.attend_absorbed(q_nope, q_rot, garbage, rot, pos)[1], absorbed[1])
        garbage[1, 0] += 1.0  # sequence 1's one key: seen
        assert not torch.allclose(attn.attend_absorbed(q_nope, q_rot, garbage, rot, pos)[1], absorbed[1])

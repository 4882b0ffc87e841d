"""bench/tools/prefill_hand_off.py: its override of the CPU share's hand-off, and its restoring."""

from __future__ import annotations

import pytest

from bench.tools.prefill_hand_off import handing_off
from strata.runtime.offload.cpu_compute import CpuCompute


class Share(CpuCompute):
    def __init__(self, split: bool):
        self.split = split


@pytest.mark.parametrize("on", [False, True])
def test_the_override_sets_every_engines_hand_off_and_restores_it(on):
    beside_gpu, cpu_only = Share(split=True), Share(split=False)
    assert (beside_gpu.hands_off, cpu_only.hands_off) == (False, True)  # as shipped
    with handing_off(on):
        assert beside_gpu.hands_off is on and cpu_only.hands_off is on
    assert (beside_gpu.hands_off, cpu_only.hands_off) == (False, True)
    with pytest.raises(RuntimeError), handing_off(on):
        raise RuntimeError("a failed prefill")
    assert beside_gpu.hands_off is False

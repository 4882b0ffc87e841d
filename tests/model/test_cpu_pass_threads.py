"""torch's intra-op threads in a CPU forward pass, for every architecture's model: one in a decode pass (an OpenMP team
there only waits, and on a busy host its other thread waits for a core: decode collapsed to a tenth of its rate
beside two CPU-bound processes), the engine's count in a prompt pass (oneDNN's GEMMs use them)."""

from __future__ import annotations

import pytest
import torch

from strata import Engine
from strata.kernels.cpu import dense
from strata.runtime.demo.model import write_demo_model

ARCHES = [None, "glm4_moe", "deepseek_v2", "minimax_m2", "deepseek_v4", "qwen3_5_moe", "gpt_oss"]


class ThreadsSeen:
    """A layer observer recording (rows of the pass, torch's threads on the pass's thread) after each layer."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        self.seen.append((hidden.shape[0], torch.get_num_threads()))


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a or "deepseek_v3")
def test_decode_passes_run_on_one_torch_thread(arch, tmp_path):
    model_dir = write_demo_model(tmp_path / "m", "tiny", arch=arch, engram=False, progress=False)
    with Engine.from_pretrained(model_dir, device="cpu", config={"runtime": {"max_context": 128, "threads": 2}}) as e:
        observer, before = ThreadsSeen(), e.model.layer_observer
        e.model.layer_observer = observer
        try:
            e.generate(list(range(5, 5 + 2 * dense.MAX_ROWS)), max_tokens=4, temperature=0.0)
        finally:
            e.model.layer_observer = before
        prompt = {t for rows, t in observer.seen if rows > dense.MAX_ROWS}
        decode = {t for rows, t in observer.seen if rows <= dense.MAX_ROWS}
        assert prompt == {e.model.prompt_threads} and e.model.prompt_threads == 2
        assert decode == {1}

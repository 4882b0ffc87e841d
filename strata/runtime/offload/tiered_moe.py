"""Routed experts served by the tier manager instead of held in memory.

`TieredExperts` replaces a layer's stacked `Experts`. Two paths, chosen by the step's shape:

Decode (a few tokens, GPU tier; `strata.runtime.offload.tiered_decode`): the pair kernels compute every (token,
expert) pair whose expert is resident in one launch per projection, and the cold pairs are split between CPU threads
computing from pinned RAM and copies into GPU slots; once every expert sits in pinned RAM for good, a decode step is
one graph, its cold pairs on a native CPU worker and the GPU's in-place reads.

Prefill and large batches (`strata.runtime.offload.tiered_prefill`): tokens are grouped by expert and each
expert acquired on the GPU runs as one GEMM over its tokens; every cold expert crosses PCIe once per
forward pass.

Both ask the cost model which cold experts the CPU computes (`TieredExperts._cpu_share`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from strata.kernels.experts import SwiGLUForm, down_bias_term, group_by_expert, group_by_expert_with_host
from strata.kernels.gpu.experts.grouped import use_pair_kernels
from strata.runtime.model.capture import current_capture_mode, current_recorder
from strata.runtime.model.moe import MoEBlock, router_predictors
from strata.runtime.model.transformer import MoETransformer
from strata.runtime.offload.cost_model import split_cold
from strata.runtime.offload.cpu_compute import CpuShare
from strata.runtime.offload.expert_compute import ExpertCompute
from strata.runtime.offload.step_io import pairs_by_expert
from strata.runtime.offload.tiered_decode import DecodePath
from strata.runtime.offload.tiered_prefill import PrefillPath

__all__ = ["ExpertCompute", "TieredExperts", "use_tiered_experts"]


class TieredExperts(PrefillPath, DecodePath, nn.Module):
    """One MoE layer's routed experts, fetched from tiers; same math as `Experts`."""

    def __init__(self, layer: int, num_experts: int, compute: ExpertCompute):
        super().__init__()
        self.layer, self.num_experts, self.compute = layer, num_experts, compute

    def decode_slots(self, x: torch.Tensor) -> torch.Tensor | None:
        """This layer's expert -> slot table [E] int32 when the step is a one-graph (mailbox) decode, so the router
        looks each pair's slot up in its own launch (`MoEBlock`); None otherwise."""
        c = self.compute
        if c.mailbox is None or c.slots is None or current_capture_mode() != "mailbox":
            return None
        return c.slot_of[self.layer]

    def look_ahead(self, hidden: torch.Tensor) -> None:
        """In a one-graph decode step with warm-ahead: predict the next layer's experts from this layer's residual
        stream hidden [N, H] and plan the worker's read of the cold ones, on the plan's stream
        (strata.runtime.offload.warm_ahead)."""
        c = self.compute
        if c.warm_ahead is not None and c.mailbox is not None and current_capture_mode() == "mailbox":
            if self.layer == c.moe_layers[0]:
                c.mailbox.begin_step(early=True)  # the step's generation, before the plan's stream forks from here
            c.warm_ahead.predict(self.layer, hidden)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None,
                used: torch.Tensor | None = None) -> torch.Tensor:
        """`Experts.forward` from tiers: x [N, H], ids and weights [N, k] -> [N, H] (+ residual). used [N * k]
        int32: each pair's GPU slot as the router looked it up (`decode_slots`; None: looked up here)."""
        c = self.compute
        if c.device_tier == "cpu" and x.device.type == "cpu":  # a CPU-only host: nothing staged, no pair kernels
            if (y := c.cpu_rows(self.layer, x, ids, weights, residual)) is not None:
                self._note_uses(Counter(ids.reshape(-1).tolist()).items())
                return y
            out = self._cpu_tier_forward(x, ids, weights)
        else:
            if current_recorder() is None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                c.release_staged()  # eager: everything that read the last decode layer's copied slots is enqueued
            pairs = use_pair_kernels(x, ids.numel()) if c.pair_path is None else c.pair_path
            # (else: a format or form the pair kernels do not read: grouped by expert, dequantized one by one)
            if pairs and c.pairs_read_format and c.pairs_read_form:
                return self._decode_forward(x, ids, weights, residual, used)
            out = self._batch_forward(x, ids, weights)
        if not c.plain_math:  # fp32 sums: the down biases added, then rounded once
            out = self._plus_down_bias(out, ids, weights).to(x.dtype)
        return out if residual is None else residual + out

    def _down_bias_term(self, ids: torch.Tensor, weights: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """Each token's experts' down biases, weighted: [N, H] fp32 on `device` (gpt-oss), None where the layer has
        none."""
        bias = self.compute.down_bias(self.layer)
        return None if bias is None else down_bias_term(weights, ids, bias).to(device)

    def _plus_down_bias(self, out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """out [N, H] fp32 (the experts' weighted sum, or the CPU's share of it) plus `_down_bias_term` (out itself
        where the layer has none)."""
        term = self._down_bias_term(ids, weights, out.device)
        return out if term is None else out + term

    def _batch_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Prefill chunks and batches too large for the pair kernels: tokens grouped by expert."""
        c, k = self.compute, ids.shape[1]
        if c.device_tier == "cpu":
            return self._cpu_tier_forward(x, ids, weights)
        # syncs: predictions have arrived too; the split's CPU share reads its pairs on the host, brought in that sync
        groups, host_pairs = (group_by_expert_with_host(ids, self.num_experts) if c.use_split
                              else (group_by_expert(ids, self.num_experts), {}))
        self._note_uses((e, len(sel)) for e, sel in groups)
        # this layer's experts staged early, and the next layer's behind them
        ahead = self._take_ahead(ids.numel(), len(groups))
        cpu_part: tuple[torch.Tensor, CpuShare] | None = None
        try:
            if c.use_split:
                cpu_groups, groups = self._plan_split(groups)
                if cpu_groups:  # activations cross PCIe (small); weights stay in host RAM
                    cpu_part = self._start_cpu_share(x, weights, k, [(e, host_pairs[e]) for e, _ in cpu_groups])
            out = self._tier_forward(x, weights, k, groups, "gpu", ids)
            if cpu_part is not None:
                rows, share = cpu_part  # rows unique: each of out's rows gets one add, as `out + partial` would
                cpu_part = None
                out.index_add_(0, rows, share.to(out.device).to(out.dtype))  # pinned: the host goes on
            return out
        except BaseException:  # the pass stops here: nothing will compute what was staged ahead
            self._release_ahead()
            if cpu_part is not None:
                cpu_part[1].wait()  # the experts it reads stay held until it is joined
            raise
        finally:
            if ahead is not None:  # the layer's kernels are enqueued: its slots may be reused behind them
                c.manager.release_staged(ahead)

    def _cpu_tier_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """No GPU tier: every expert on the CPU, x [N, H] (on any device) -> [N, H] (fp32 where the math is not
        plain). Tokens are grouped by expert on the host, in Python for a decode step's few pairs: a CPU decode
        layer's weights have just evicted torch's dispatch path from the caches, where each of group_by_expert's
        ~20 small ops costs several times its warm time (docs/benchmarks.md, "A decode step's host work")."""
        c, k = self.compute, ids.shape[1]
        flat = ids.reshape(-1).cpu().numpy()
        groups = list(pairs_by_expert(flat, np.arange(flat.size)).items())  # [(expert, its pairs [p] int64)]
        self._note_uses((e, len(sel)) for e, sel in groups)
        if x.device.type == "cpu" and not c.use_fast_cpu and c.plain_math:  # (else cpu_forward's fp32)
            return self._tier_forward(x, weights, k, [(e, torch.from_numpy(sel)) for e, sel in groups], "cpu")
        y = c.cpu_forward(self.layer, x.cpu(), weights.cpu(), k, groups)
        return y.to(x.device, x.dtype) if c.plain_math else y.to(x.device)

    def _note_uses(self, uses: Iterable[tuple[int, int]]) -> None:
        """Count a step's (expert, tokens routed to it) in the tier policies' history, then issue the prefetches
        whose predictions have arrived. The GPU tier's history counts each token routed to an expert, not one use per
        staged expert: what the prompt uses most then outranks the rest when staging (and later promotions) pick
        victims."""
        c = self.compute
        c.manager.note_uses(self.layer, dict(uses))
        if c.prefetcher is not None:
            c.prefetcher.poll()

    # ---- the split of cold experts between the CPU and copies (decode and prefill) ------------------
    def _cpu_share(self, tokens: dict[int, int], run_async: bool | None = True) -> tuple[set[int], bool]:
        """Which cold experts (expert -> tokens routed to it) the cost model sends to the CPU (measured rates,
        and copies already queued, e.g. prefetches, counted against the copy path), and whether the CPU share
        starts before the copies are staged (`run_async`; None: when that plan copies any)."""
        c = self.compute
        c.rates.pcie_bytes_per_s = c.manager.observed_rate("pinned->gpu", c.rates.pcie_bytes_per_s)
        nbytes = c.manager.store.payload_bytes
        backlog = c.manager.gpu_transfers_in_flight() * nbytes / c.rates.pcie_bytes_per_s
        plan = lambda serial: split_cold(tokens, nbytes, c.rates, in_flight_copy_s=backlog, serial=serial)  # noqa: E731
        split = plan(run_async is False)  # serial only when the CPU share is to run after the copies
        if run_async is None:  # auto: first only when that plan copies some and computes some on the CPU
            run_async = bool(split.copy and split.cpu)
            if not run_async:
                split = plan(True)
        if not split.copy or not split.cpu:
            return set(split.cpu), run_async
        # the cost model fixes how many experts of each token count are copied; which ones: the most used
        # (a copy may stay in the GPU tier, see `worth_caching`), so a popular expert is not left to the CPU
        score = c.manager.gpu_scores(self.layer, tokens)
        copied: set[int] = set()
        for t in {tokens[e] for e in split.copy}:
            n = sum(1 for e in split.copy if tokens[e] == t)
            same = sorted((e for e in tokens if tokens[e] == t), key=lambda e: (-score[e], e))
            copied.update(same[:n])
        return set(tokens) - copied, run_async


def use_tiered_experts(model: MoETransformer, compute: ExpertCompute) -> None:
    """Swap every MoE layer's stacked experts for tier-served ones (before weights are loaded)."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.experts = TieredExperts(i, model.cfg.num_experts, compute)
            compute.moe_layers.append(i)
    compute.top_k = model.cfg.num_experts_per_tok
    if model.cfg.deepseek_v4 is not None:
        compute.form = SwiGLUForm(limit=model.cfg.deepseek_v4.swiglu_limit)
    for i, layer in enumerate(model.layers):  # gpt-oss: its clamped form; the biases stay with the layer
        if (math := getattr(layer.mlp, "expert_math", None)) is not None:
            compute.form, compute.expert_biases[i] = math.form, math.biases
    compute.predictors = router_predictors(model, beside=True)

"""What a forward pass tells the executor of a model's experts, besides running its layers.

The model calls two collaborators, each given once when the model is built (strata.runtime.plan.build and
strata.runtime.plan.multi_device), both optional (a model with every expert in memory has neither):

- a `LayerObserver`, given to `MoETransformer.observe_layers`: told after every decoder layer, with its output.
  The tiered executor's lookahead prefetch predicts the next layers' experts from it (`ExpertCompute`, one card;
  `StagedPrefetcher`, a model split over cards).
- `GraphStepHooks`, given to `MoETransformer.enable_decode_graphs`: told around each decode step that runs as a
  CUDA graph. One-graph split decode keeps its books there (`ExpertCompute`: the mailbox worker's statistics,
  its GPU share's balance, promotions), outside the graph and off the launch's path.

Call order for one decode step replayed from a graph (strata.runtime.model.graphs.DecodeGraphs.run):

    hooks.after_queued(event)    the previous step's, if its caller never called `step_queued`
    hooks.before_step()          before the inputs are copied and the graph launched
    graph.replay()               no Python per layer: `after_layer` ran once, while the graph was captured
    ... the caller queues the LM head, sampling and read-back, then calls `DecodeGraphs.step_queued()`:
    hooks.after_queued(event)    the event is reached once the GPU has done all of that

An eager pass (prefill chunks, decode without graphs) calls `after_layer` after every layer and neither hook.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerObserver(Protocol):
    """Told after each decoder layer of a forward pass (`MoETransformer.observe_layers`)."""

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Decoder layer `layer` has run; hidden [N, H] is its output (the residual stream entering layer + 1).
        Called while a decode step is captured too: work meant for each replay goes through the capture in
        progress (strata.runtime.model.capture)."""


class GraphStepHooks(Protocol):
    """Told around each decode step that runs as a CUDA graph (`MoETransformer.enable_decode_graphs`)."""

    def before_step(self) -> None:
        """A decode step is about to be replayed or captured (not for steps that run eagerly). May raise: the
        step then does not run."""

    def after_queued(self, until: torch.cuda.Event) -> None:
        """Once per replayed step, after its caller queued the rest of the step's work (LM head, sampling, the
        tokens' read-back) or, if it never says so, before the next step: host work that can run while the GPU
        does. `until` is recorded after that work: reached once the GPU is done, so the work can stop there."""

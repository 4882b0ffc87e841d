"""How a model routes, for the suite: strata.runtime.model.routing_stats (per-layer expert popularity, lookahead
recall, temporal overlap), which the suite's cases and probes import from here."""

from __future__ import annotations

from strata.runtime.model.routing_stats import (
    count_routing,
    lookahead_recall,
    popularity_summary,
    record_choices,
    record_lookahead,
    temporal_overlap,
)

__all__ = ["count_routing", "lookahead_recall", "popularity_summary", "record_choices", "record_lookahead",
           "temporal_overlap"]

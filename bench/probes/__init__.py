"""Probes behind defaults: each measures one mechanism alone, where a default of strata came from."""

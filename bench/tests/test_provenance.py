"""bench/provenance.py: the commit a bench script records."""

from __future__ import annotations

import re

from bench.provenance import commit


def test_the_commit_is_the_one_told_else_the_checkouts(monkeypatch):
    monkeypatch.setenv("STRATA_BENCH_COMMIT", "f84bb6b")
    assert commit() == "f84bb6b"  # a tree copied without .git, as the GPU machine gets
    monkeypatch.delenv("STRATA_BENCH_COMMIT")
    assert commit() == "" or re.fullmatch(r"[0-9a-f]{7,40}", commit())

"""What the report's tables share: figures as table cells, a result document's cases by name, a case's decode rate,
and two cases taken from one run so that their ratio compares like with like."""

from __future__ import annotations

ACROSS = " (across runs)"  # a ratio whose two cases come from different runs


def fmt(v, digits: int = 1, scale: float = 1.0) -> str:
    """A table cell: a number divided by `scale` with `digits` decimals and thousands separators, "" for None."""
    if v is None:
        return ""
    if isinstance(v, int | float):
        x = v / scale
        return f"{x:,.{digits}f}"
    return str(v)


def by_name(doc: dict) -> dict[str, dict]:
    """A result document's cases by name."""
    return {c["name"]: c for c in doc["cases"]}


def decode_tok_s(c: dict | None) -> float | None:
    """A case's decode tok/s; None when it is missing or did not run."""
    if not c or c.get("status") != "ok":
        return None
    return c["metrics"].get("decode_tok_s")


def pair(doc: dict, a: str, b: str) -> tuple[dict | None, dict | None, bool]:
    """Cases `a` and `b` from the latest run that measured both (a ratio from one run), else each one's latest
    measurement; the flag says whether they come from one run."""
    for run in reversed(list(doc.get("by_run", {}).values())):
        if decode_tok_s(run.get(a)) is not None and decode_tok_s(run.get(b)) is not None:
            return run[a], run[b], True
    cases = by_name(doc)
    x, y = cases.get(a), cases.get(b)
    return x, y, x is None or y is None or x.get("run") == y.get("run")

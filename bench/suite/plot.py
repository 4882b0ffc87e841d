"""The PNG: decode tok/s and GPU hit rate against the GPU expert budget (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path


def available() -> bool:
    """Whether matplotlib can be imported (the plot is optional: `scripts/install.sh bench`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(doc: dict, path: str | Path, workload: str = "p128x1") -> Path | None:
    """Write the figure; None when matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [c for c in doc["cases"] if c["status"] == "ok" and c["name"].endswith(f"/{workload}")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    drawn = False
    for routing, style in (("uniform", "o-"), ("skewed", "s--")):
        for variant in ("split", "static", "naive"):
            pts = sorted(((100 * c["budget"]["gpu_fraction"], c["metrics"]) for c in ok
                          if c["variant"] == variant and c["routing"] == routing and c["budget"]["ram_fraction"] is None),
                         key=lambda p: p[0])  # by budget alone: two cases at one budget must not compare their dicts
            if not pts:
                continue
            drawn = True
            label = f"{variant}, {routing}"
            ax1.plot([p for p, _ in pts], [m["decode_tok_s"] for _, m in pts], style, label=label)
            hits = [(p, m["gpu_hit_rate"]) for p, m in pts if m.get("gpu_hit_rate") is not None]
            if hits:
                ax2.plot([p for p, _ in hits], [h for _, h in hits], style, label=label)
        ceiling = [c for c in ok if c["variant"] == "ceiling" and c["routing"] == routing]
        if ceiling:
            ax1.axhline(ceiling[0]["metrics"]["decode_tok_s"], ls=":" if routing == "uniform" else "-.", color="gray",
                        label=f"all in VRAM, {routing}")
    if not drawn:
        plt.close(fig)
        return None
    ax1.set(xlabel="GPU expert budget (% of expert bytes)", ylabel="decode tok/s (1 stream)", title="decode speed")
    ax2.set(xlabel="GPU expert budget (% of expert bytes)", ylabel="GPU hit rate", title="GPU hit rate", ylim=(0, 1.02))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_llamacpp(doc: dict, path: str | Path) -> Path | None:
    """strata / llama.cpp per case (`llamacpp_rows`: decode for pNxS, prefill for the long prompts), a bar per GGUF
    export; None when matplotlib is missing or no llama.cpp case ran."""
    from bench.suite.llamacpp_table import llamacpp_rows

    rows = llamacpp_rows(doc)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not rows:
        return None
    labels = [f"{r['routing']} {r['budget']} {r['workload']} ({r['measure']})" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    height = 0.4
    for i, export in enumerate(("bf16", "Q4_K_M")):
        ratios = [(r["llamacpp"].get(export) or {}).get("ratio") or 0.0 for r in rows]
        if any(ratios):
            ax.barh([y + (i - 0.5) * height for y in range(len(rows))], ratios, height,
                    label=f"llama.cpp {export} GGUF")
    ax.axvline(1.0, color="gray", ls=":")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="strata / llama.cpp (tok/s; > 1: strata faster)", title="strata against llama.cpp, same weights")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The benchmark suite: strata against its roofline and its baselines, in one run.

    python -m bench run [--suite quick|full] [--out DIR] [--model PATH] [--cases PATTERN ...]
    python -m bench report RESULT.json [MORE.json ...] [--results docs/benchmarks.md] [--plot PNG]
    python -m bench list [--suite full]

Modules: `cases` (what is measured), `models` (the demo checkpoints), `strata_case` / `hf_case` /
`serve_case` (how), `roofline` (the bound each case is judged against), `results` (the JSON, the
machine), `report` / `plot` (the report's tables and the PNG), `runner` (the order, the deadline).
"""

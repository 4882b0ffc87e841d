"""`python -m bench`: the benchmark suite.

    python -m bench run [--suite quick|full|llamacpp] [--out DIR] [--model PATH] [--cases PATTERN ...]
                        [--baselines llamacpp] [--llamacpp-src SDIST | --llamacpp-bin DIR]
    python -m bench report OUT/suite.json [MORE.json ...] [--results docs/benchmarks.md]
    python -m bench list [--suite quick|full]

`run` writes OUT/suite.json (raw results, rewritten after every engine), OUT/suite.md (the benchmark
report's suite section) and OUT/suite.png; `report` merges result files (later ones win per case) and
regenerates the section between the suite markers of the benchmark report, plus the PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from bench.suite.cases import SUITES, select, with_baselines
from bench.suite.models import EXPERT_FORMATS

REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # the benchmark report
DEFAULT_LAYERS = {"quick": 12, "full": 24, "llamacpp": 12}
DEFAULT_DEADLINE = {"quick": 540, "full": 560, "llamacpp": 540}  # seconds: inside one 10-minute GPU call


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure strata and its baselines")
    r.add_argument("--suite", choices=sorted(SUITES), default="quick")
    r.add_argument("--cases", nargs="*", default=None, metavar="PATTERN",
                   help="only cases whose name matches (shell patterns, e.g. 'split/b25/*' '*/skewed/p128x1')")
    r.add_argument("--out", default="bench-out")
    r.add_argument("--model", default=None, help="a checkpoint to use (its routing read from its demo marker) "
                                                 "instead of writing the uniform and skewed demo models")
    r.add_argument("--models-dir", default="/dev/shm/strata-suite/models", help="where the demo models are written")
    r.add_argument("--size", default="bench", choices=["tiny", "small", "bench"])
    r.add_argument("--layers", type=int, default=None, help="demo model layers (quick: 12, full: 24)")
    r.add_argument("--skew", type=float, default=1.0, help="--route-skew of the skewed checkpoint (default 1)")
    r.add_argument("--locality", type=float, default=None,
                   help="--route-locality of the skewed checkpoint (temporal locality; default 1 for the bench size, "
                        "where consecutive tokens then share ~0.49 of their experts against ~0.34 from popularity alone, "
                        "0 for the others, which it is not written for; 0: none)")
    r.add_argument("--experts", default="bf16", choices=EXPERT_FORMATS,
                   help="the demo models' expert format (strata demo-model --experts): bf16, fp8 (block-scaled, as "
                        "DeepSeek-V3 ships), mxfp4 (as gpt-oss ships), or a GGUF export type (q4_k_m, q2_k, ...: the "
                        "bf16 model exported as a GGUF file, which strata runs); the transformers baseline runs bf16 "
                        "only")
    r.add_argument("--tokens", type=int, default=None, help="generated tokens per stream (quick: 64, full: 128)")
    r.add_argument("--cache", default="/dev/shm/strata-suite/cache", help="tiers.disk.path: where stores are built")
    r.add_argument("--disk-cache", default="~/.cache/strata-suite", help="store location of the disk case (real disk)")
    r.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    r.add_argument("--token-budget", type=int, default=2048, help="scheduler tokens per step (prefill chunks)")
    r.add_argument("--deadline", type=float, default=None, help="seconds after which remaining cases are skipped")
    r.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each strata case on its engine; the report takes the median decode run's figures")
    r.add_argument("--hf-limit", type=float, default=180, help="seconds the transformers baseline may take per case")
    r.add_argument("--rates", choices=["measure", "limits"], default="measure",
                   help="roofline PCIe/HBM rates measured now, or all the reference figures (bench/suite/roofline.py)")
    r.add_argument("--results", default=None, help="also regenerate this report's suite section (docs/benchmarks.md)")
    r.add_argument("--baselines", nargs="*", default=[], metavar="NAME",
                   help="add, for every selected strata split case, the same case run by llama.cpp: llamacpp (bf16 "
                        "GGUF), llamacpp-q4_k_m (Q4_K_M experts); the llamacpp suite has them already")
    r.add_argument("--llamacpp-src", default=os.environ.get("STRATA_LLAMACPP_SRC") or _packed_source(),
                   help="llama.cpp to build the baseline's tools from: the llama-cpp-python sdist, the stripped "
                        ".gpu/llama.cpp-src.tar.gz (the default when present) or a llama.cpp tree")
    r.add_argument("--llamacpp-bin", default=os.environ.get("STRATA_LLAMACPP_BIN"),
                   help="a directory with llama-bench and llama-batched-bench already built (nothing is built)")
    r.add_argument("--llamacpp-root", default=None,
                   help="where llama.cpp's source is prepared and built (default $STRATA_CACHE/bench/llamacpp)")
    r.add_argument("--llamacpp-threads", type=int, default=None, help="llama.cpp's -t (default: the physical cores)")
    r.add_argument("--set", default=None, metavar="JSON",
                   help='strata config merged over every strata case\'s (A/B runs), e.g. \'{"debug": {"overlap_decode": false}}\'')
    p = sub.add_parser("report", help="regenerate the report's suite section and the PNG from result JSON files")
    p.add_argument("json", nargs="+")
    p.add_argument("--results", default=str(REPORT), help="the report whose suite section is regenerated")
    p.add_argument("--plot", default=None, help="PNG path (default: suite.png next to the report)")
    p.add_argument("--command", default=None, help="the command line to quote in the section (with --append: "
                                                     "what is added to the section's command, after '; ')")
    p.add_argument("--append", action="store_true",
                   help="merge the JSON files after the runs the current section lists (its file list and command "
                        "are kept), instead of from them alone")
    lst = sub.add_parser("list", help="list the case names of a suite")
    lst.add_argument("--suite", choices=sorted(SUITES), default="full")
    lst.add_argument("--cases", nargs="*", default=None)
    return ap


def _packed_source() -> str | None:
    """.gpu/llama.cpp-src.tar.gz of this checkout, when bench/gpu_run.sh `wheels` wrote it."""
    packed = Path(__file__).resolve().parent.parent / ".gpu" / "llama.cpp-src.tar.gz"
    return str(packed) if packed.is_file() else None


def _locality(args: argparse.Namespace) -> float:
    """--locality, or its default: 1 for the bench size (the recency head is written for its Qwen3-MoE shapes), else 0."""
    if args.locality is not None:
        return args.locality
    return 1.0 if args.size == "bench" else 0.0


def _settings(args: argparse.Namespace) -> dict:
    layers = args.layers if args.layers is not None else (DEFAULT_LAYERS[args.suite] if args.size == "bench" else None)
    return {
        "suite": args.suite, "device": args.device, "cache": args.cache,
        "disk_cache": str(Path(args.disk_cache).expanduser()), "models_dir": args.models_dir, "size": args.size,
        "layers": layers, "skew": args.skew, "locality": _locality(args), "model": args.model, "token_budget": args.token_budget,
        "repeats": args.repeats,
        "experts": args.experts,
        "placement_timeout": 120.0, "hf_limit_s": args.hf_limit,
        "deadline_s": args.deadline if args.deadline is not None else DEFAULT_DEADLINE[args.suite],
        "progress": sys.stderr.isatty(), "set": _config_json(args.set),
        "llamacpp_src": args.llamacpp_src, "llamacpp_bin": args.llamacpp_bin, "llamacpp_root": args.llamacpp_root,
        "llamacpp_threads": args.llamacpp_threads,
    }


def _config_json(text: str | None) -> dict:
    """--set's JSON object (a strata config fragment)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--set is not valid JSON ({e}); give a config object, e.g. '{{\"runtime\": {{...}}}}'") from None
    if not isinstance(value, dict):
        raise SystemExit("--set must be a JSON object of config sections, e.g. '{\"runtime\": {...}}'")
    return value


def cmd_run(args: argparse.Namespace) -> int:
    from bench.suite import report, results
    from bench.suite.plot import plot, plot_llamacpp
    from bench.suite.roofline import Rates
    from bench.suite.runner import run_suite

    tokens = args.tokens or (128 if args.suite == "full" else 64)
    cases = with_baselines(select(SUITES[args.suite](tokens), args.cases), args.baselines)
    settings = _settings(args)
    doc = run_suite(cases, settings, args.out, log=lambda s: print(s, flush=True),
                    rates=Rates() if args.rates == "limits" else None)
    out = Path(args.out)
    command = "python -m bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    png = plot(doc, out / "suite.png")
    _say_why_no_plot(png)
    versus = plot_llamacpp(doc, out / "suite-llamacpp.png")
    section = report.render(doc, command, png.name if png else None, versus.name if versus else None)
    (out / "suite.md").write_text(section)
    if args.results:
        report.update_report(args.results, section)
    problems = results.validate(doc)
    bad = [c for c in doc["cases"] if c["status"] == "error"]
    print(f"wrote {out / results.RESULT_FILE} ({len(doc['cases'])} cases, {len(bad)} errors"
          f"{', schema problems: ' + '; '.join(problems) if problems else ''})")
    return 1 if problems else 0


def _say_why_no_plot(png: Path | None) -> None:
    from bench.suite.plot import available

    if png is None and not available():
        print("no plot: matplotlib is not installed (scripts/install.sh bench); the section is written without one")


def cmd_report(args: argparse.Namespace) -> int:
    from bench.suite import report, results
    from bench.suite.plot import plot, plot_llamacpp

    files, command = list(args.json), args.command
    if args.append:
        listed, quoted = report.section_sources(args.results)
        if not listed:
            print(f"bench report: {args.results} has no suite section listing its runs' files to append to; "
                  "pass every file without --append", file=sys.stderr)
            return 2
        missing = [f for f in listed if not Path(f).is_file()]
        if missing:
            print(f"bench report: the section lists {missing[0]}, which is not there (run from the repository root)",
                  file=sys.stderr)
            return 2
        files = listed + [f for f in files if f not in listed]
        command = "; ".join(c for c in (quoted, args.command) if c) or None
    doc = results.load(files)
    png_path = Path(args.plot) if args.plot else Path(args.results).with_name("suite.png")
    png = plot(doc, png_path)
    _say_why_no_plot(png)
    rel = png.name if png and png.parent == Path(args.results).parent else (str(png) if png else None)
    versus = plot_llamacpp(doc, png_path.with_name(png_path.stem + "-llamacpp.png"))
    versus_rel = versus.name if versus and versus.parent == Path(args.results).parent else (str(versus) if versus else None)
    report.update_report(args.results, report.render(doc, command, rel, versus_rel))
    print(f"updated {args.results} from {len(doc['cases'])} cases" + (f"; plot {png}" if png else ""))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    for c in select(SUITES[args.suite](), args.cases):
        print(c.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"run": cmd_run, "report": cmd_report, "list": cmd_list}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

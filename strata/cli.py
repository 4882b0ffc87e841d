"""The `strata` command line: inspect, generate, demo-model.

Every user-caused failure prints one line, `strata: error: ...`, and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from strata.errors import StrataError


def _cmd_inspect(args: argparse.Namespace) -> int:
    from strata.runtime.inspect import format_summary, summarize_checkpoint

    t0 = time.perf_counter()
    summary = summarize_checkpoint(args.model)
    print(format_summary(summary))
    print(f"(read from headers in {1000 * (time.perf_counter() - t0):.0f} ms)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from strata.engine import Engine

    config = args.config
    if args.gpus:  # one model split over several GPUs (runtime.devices)
        from strata.config import load_config, parse_gpus

        config = load_config(args.config)
        config.runtime.devices = parse_gpus(args.gpus)
        config.runtime.__post_init__()
    engine = Engine.from_pretrained(args.model, config=config, device=args.device, progress=sys.stderr.isatty())
    try:  # closed on every way out: its transfer workers and native threads stop before the interpreter does
        return _generate(engine, args)
    finally:
        engine.close()


def _generate(engine, args: argparse.Namespace) -> int:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop or None, reproducible=args.reproducible)
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt = args.prompt
        sys.stdout.write(args.prompt)
    try:
        for piece in engine.stream(prompt, **kwargs):
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:  # the text so far ends its line, so an error (or ^C) is printed on one of its own
        sys.stdout.write("\n")
        sys.stdout.flush()
    stats = engine.stats()
    print(
        f"[{stats['generated_tokens']} tokens, prefill {stats['prefill_tokens_per_s']:.1f} tok/s, "
        f"decode {stats['decode_tokens_per_s']:.1f} tok/s on {stats['device']} ({stats['dtype']})]",
        file=sys.stderr,
    )
    return 0


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from strata.runtime.demo_model import write_demo_model

    out = write_demo_model(args.dir, size=args.size, layers=args.layers, progress=True, engram=not args.no_engram,
                           route_skew=args.route_skew, route_locality=args.route_locality)
    print(f"wrote the {args.size} demo model to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Serve MoE models larger than the GPU.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarise a checkpoint from its headers alone")
    p.add_argument("model", help="Hugging Face checkpoint directory")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("generate", help="generate text, streamed to stdout")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--reproducible", action="store_true",
                   help="cold experts on the exact path (the GPU or the reference math): bit-identical to the server's "
                        "strata_reproducible requests")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--gpus", default=None, help="split the model over these GPUs, e.g. 0,1 (runtime.devices)")
    p.add_argument("--config", default=None, help="config.toml with overrides")
    p.set_defaults(func=_cmd_generate)

    from strata.runtime.planner import add_plan_arguments, cmd_plan
    from strata.server.serve import add_serve_arguments, cmd_serve

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="where each expert would live on this host (from headers alone)")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    from strata.runtime.convert import cmd_convert, cmd_verify

    p = sub.add_parser("convert", help="pack a checkpoint into a tiered expert store")
    p.add_argument("model", help="Hugging Face checkpoint directory")
    p.add_argument("store", help="store directory to create")
    p.add_argument("--config", default=None, help="config.toml (accepted for symmetry; conversion has no options yet)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("verify", help="re-read every blob of a store and check it against the index")
    p.add_argument("store")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("demo-model", help="write a deterministic random-weight demo checkpoint")
    p.add_argument("dir")
    p.add_argument("--size", default="small", choices=["tiny", "small", "bench"])
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the size's default")
    p.add_argument("--no-engram", action="store_true", help="leave out the Engram layers (hashed n-gram tables)")
    p.add_argument("--route-skew", default="0", metavar="S",
                   help="expert popularity in the weights: S > 0 Zipf-like (1: typical), 'uniform', 0: plain random")
    p.add_argument("--route-locality", default="0", metavar="L",
                   help="temporal locality in the weights (Qwen3-MoE, with --route-skew): every router also weighs the "
                        "last ~tens of tokens, L times the token (0: none)")
    p.set_defaults(func=_cmd_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `strata` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

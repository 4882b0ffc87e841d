"""The `strata` command line: inspect, generate, serve, plan, convert, verify, demo-model.

Every user-caused failure prints one line, `strata: error: ...`, and exits with status 2; no traceback.
Only model text goes to stdout (`generate`); progress, the speed summary and errors go to stderr. On a
terminal, control characters in model text are shown as escapes (`terminal_safe`), never acted on.
`strata --version` and `strata --help` stay quick: nothing here imports torch until a command runs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from strata import __version__
from strata.errors import StrataError
from strata.tiers.store.gguf_mix import EXPORT_TYPES as GGUF_EXPORT_TYPES

# What a terminal acts on rather than shows: the C0 controls but tab and newline (ESC starts sequences that
# clear the screen, move the cursor, retitle the window or make some terminals type into stdin; CR overwrites
# the line), DEL, and the C1 controls (U+009B is a one-character CSI). Each is written as its escape instead.
_TERMINAL_ESCAPES: dict[int, str] = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c not in (0x09, 0x0A)}
_TERMINAL_ESCAPES.update({c: f"\\u{c:04x}" for c in range(0x80, 0xA0)})


def terminal_safe(text: str) -> str:
    """`text` with every C0 control but tab and newline, DEL and every C1 control written as a visible escape
    (`\\x1b`, `\\u009b`); all else is unchanged (U+FFFD too: it is printable)."""
    return text.translate(_TERMINAL_ESCAPES)


def _writer(stream: TextIO) -> Callable[[str], object]:
    """A function writing text to `stream`: through `terminal_safe` when it is a terminal, as is otherwise."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return lambda text: stream.write(terminal_safe(text))
    return stream.write


def _print_error(message: str) -> None:
    _writer(sys.stderr)(f"strata: error: {message}\n")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from strata.runtime.plan.checkpoints.inspect import format_summary, summarize_checkpoint

    t0 = time.perf_counter()
    if str(args.model).endswith(".gguf"):  # a GGUF file: its metadata and tensor infos
        from strata.runtime.plan.checkpoints.gguf_inspect import summarize_gguf

        summary = summarize_gguf(args.model)
    else:
        summary = summarize_checkpoint(args.model)
    print(format_summary(summary))
    print(f"(read from headers in {1000 * (time.perf_counter() - t0):.0f} ms)")
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling keyword arguments of `Engine.stream`, from `strata generate`'s options."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop or None)


def _cmd_generate(args: argparse.Namespace) -> int:
    from strata.runtime.generation.sampler import SamplingParams

    SamplingParams(**_sampling(args))  # a bad value is refused here, before the prompt is echoed or the model loads
    from strata.engine import Engine

    config = args.config
    if args.gpus:  # one model split over several GPUs (runtime.devices)
        from strata.config import load_config
        from strata.config_values import parse_gpus

        config = load_config(args.config)
        config.runtime.devices = parse_gpus(args.gpus)
        config.runtime.__post_init__()
    engine = Engine.from_pretrained(args.model, config=config, device=args.device, progress=sys.stderr.isatty())
    try:  # closed on every way out: its transfer workers and native threads stop before the interpreter does
        return _generate(engine, args)
    finally:
        engine.close()


def _generate(engine, args: argparse.Namespace) -> int:
    write = _writer(sys.stdout)
    prompt = engine.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    stream = engine.stream(prompt, **_sampling(args), reproducible=args.reproducible)  # a refused prompt raises here
    if not args.chat:
        write(args.prompt)
    try:
        for piece in stream:
            write(piece)
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from strata.server.serve import cmd_serve

    return cmd_serve(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from strata.runtime.plan.planner import cmd_plan

    return cmd_plan(args)


def _cmd_convert(args: argparse.Namespace) -> int:
    from strata.runtime.plan.checkpoints.convert import cmd_convert

    return cmd_convert(args)


def _cmd_verify(args: argparse.Namespace) -> int:
    from strata.runtime.plan.checkpoints.convert import cmd_verify
    from strata.runtime.plan.checkpoints.in_place import is_served_in_place, verify_in_place

    if is_served_in_place(args.store):
        return verify_in_place(args.store, args.config)
    return cmd_verify(args)


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from strata.runtime.demo.model import write_demo_model

    if args.experts is None:  # gpt-oss as released: MXFP4 experts; every other architecture bf16
        args.experts = "mxfp4" if args.arch == "gpt_oss" else "bf16"
    if args.gguf:  # refused before the checkpoint is written
        from strata.runtime.demo.demo_gguf import check_demo_gguf

        check_demo_gguf(args.gguf, args.size, args.layers, not args.no_engram, args.arch, args.experts)
    out = write_demo_model(args.dir, size=args.size, layers=args.layers, progress=True, engram=not args.no_engram,
                           route_skew=args.route_skew, route_locality=args.route_locality, experts=args.experts,
                           arch=args.arch)
    what = "trained demo model" if args.size == "demo" else f"{args.size} random-weight demo model"
    what += f" ({args.arch})" if args.arch else ""
    what += f" ({args.experts})" if args.experts != "bf16" else ""
    print(f"wrote the {what} to {out}")
    if args.gguf:
        from strata.runtime.demo.demo_gguf import write_demo_gguf

        print(f"wrote its GGUF ({args.gguf} experts) to {write_demo_gguf(out, args.gguf)}")
    return 0


class _Parser(argparse.ArgumentParser):
    """The top-level parser: a name that is not a command is one line naming the commands, not usage and a list."""

    commands: dict[str, argparse.ArgumentParser]  # the subparsers by name, set by build_parser

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        argv = list(sys.argv[1:] if args is None else args)
        name = command_in(argv)
        if name is not None and name not in self.commands:
            close = difflib.get_close_matches(name, self.commands, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; commands: {', '.join(self.commands)}"
            self.exit(2, f"{self.prog}: error: unknown command {name!r}{hint}\n")
        return super().parse_known_args(argv, namespace)


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in `argv`: its first word that is not an option (the top level's options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `strata` argument parser, every subcommand listed.

    `serve` and `plan` describe their arguments in modules that import torch; with `only` set, those arguments
    are added for that one command alone (`main` passes the command on its line), so `strata --help` and
    `strata --version` import no torch. `only=None` adds every command's arguments.
    """
    parser = _Parser(prog="strata", description="Serve Mixture-of-Experts models larger than the GPU, each expert "
                     "in the tier it earns. `strata COMMAND --help` describes a command.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print strata's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=argparse.ArgumentParser)
    parser.commands = sub.choices

    p = sub.add_parser("inspect", help="summarise a checkpoint from its headers alone")
    p.add_argument("model", help="Hugging Face checkpoint directory, store, or .gguf file (only config.json and the "
                   "tensor headers are read)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("generate", help="generate text, streamed to stdout")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint or store directory (default: the demo model, written on first use)")
    p.add_argument("--prompt", required=True, metavar="TEXT",
                   help="text to continue; echoed before the generated text unless --chat is given")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="most tokens to generate, at least 1 (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature in [0, 100]; 0 always picks the most likely token (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the fewest most likely tokens whose probabilities reach P, in (0, 1]; "
                        "1 keeps all (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K most likely tokens; 0 keeps all (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="random seed: the same seed, prompt and options give the same text "
                        "(default: a fresh seed each run)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the text before the first occurrence of TEXT; repeat for several, up to 16 (default: none)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template (not echoed)")
    p.add_argument("--reproducible", action="store_true",
                   help="cold experts on the exact path (the GPU or the reference math): bit-identical to the server's "
                        "strata_reproducible requests")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N (default: %(default)s, the config's runtime.device: "
                        "the GPU when there is one)")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="split the model over these GPUs, e.g. 0,1 (runtime.devices; default: one device)")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="config.toml with overrides (default: the built-in settings)")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    if only in (None, "serve"):
        from strata.server.serve import add_serve_arguments

        add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("plan", help="where each expert would live on this host (from headers alone)")
    if only in (None, "plan"):
        from strata.runtime.plan.planner import add_plan_arguments

        add_plan_arguments(p)
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("convert", help="pack a checkpoint into a tiered expert store")
    p.add_argument("model", help="Hugging Face checkpoint directory, or a .gguf file (a split file: any of its parts)")
    p.add_argument("store", help="store directory to write (new or empty; an existing store of this checkpoint is kept)")
    p.add_argument("--experts", default=None, choices=["checkpoint", "fp8", "mxfp4"],
                   help="routed experts as the checkpoint ships them, or a bf16 checkpoint's quantized while packing: "
                        "fp8 (128x128 blocks, or the largest of 64/32/16 dividing the expert width) or mxfp4 "
                        "(default: the config's store.experts, \"checkpoint\")")
    p.add_argument("--config", default=None, metavar="PATH", help="config.toml ([store] experts)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("verify", help="re-read every blob of a store (or every part of a checkpoint served in place) "
                                      "and check it against its recorded checksum")
    p.add_argument("store", help="store directory written by `strata convert` (or by `generate`/`serve` on first use), "
                                 "or a checkpoint directory served in place")
    p.add_argument("--config", default=None, metavar="PATH", help="config.toml (where the in-place index lives)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("demo-model", help="write the trained demo model, or a deterministic random-weight one")
    p.add_argument("dir", help="directory to write (new or empty; one holding the same demo model is kept)")
    p.add_argument("--size", default="demo", choices=["demo", "tiny", "small", "bench"],
                   help="demo: the default model, trained on the KJV Bible and fortunes (6 layers x 32 experts, Engram, "
                        "~18 MB); random weights: tiny (3 layers x 16 experts, ~1 MB, for tests), small (8 layers x 64 "
                        "experts, ~390 MB), bench (Qwen3-30B-A3B's configuration, 48 layers x 128 experts, ~61 GB) "
                        "(default: %(default)s)")
    p.add_argument("--arch", default=None, choices=["glm4_moe", "deepseek_v2", "deepseek_v4", "minimax_m2",
                                                    "qwen3_5_moe", "gpt_oss"],
                   help="random sizes in another architecture: glm4_moe (tiny; bench: GLM-4.5-Air's configuration, 46 "
                        "layers x 128 experts, ~214 GB), deepseek_v2 (tiny; bench: DeepSeek-V2-Lite's, 27 layers "
                        "x 64 experts, ~32 GB) or deepseek_v4 (tiny; small: 8 layers x 64 experts, ~440 MB; bench: "
                        "DeepSeek-V4-Flash's configuration, 43 layers x 256 experts, ~13 GB a layer) or minimax_m2 "
                        "(tiny; small: 8 layers x 64 experts, ~430 MB; bench: MiniMax-M2's configuration, 62 layers "
                        "x 256 experts, ~457 GB; ~230 GB with --experts fp8, as it ships) or qwen3_5_moe (tiny; "
                        "small: 8 layers x 64 experts, ~450 MB; bench: Qwen3.5-35B-A3B's configuration, 40 layers x "
                        "256 experts, ~69 GB) or gpt_oss (tiny; small: 8 layers x 32 experts; bench: gpt-oss-120b's "
                        "configuration, 36 layers x 128 experts in MXFP4 as released, ~61 GB; ~218 GB with --experts "
                        "bf16); --layers N writes fewer "
                        "(default: the size's own architecture)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the size's default (random sizes)")
    p.add_argument("--no-engram", action="store_true", help="leave out the Engram layers (hashed n-gram tables)")
    p.add_argument("--route-skew", default="0", metavar="S",
                   help="expert popularity in the weights: S > 0 Zipf-like (1: typical), 'uniform', 0: plain random")
    p.add_argument("--route-locality", default="0", metavar="L",
                   help="temporal locality in the weights (Qwen3-MoE, with --route-skew): every router also weighs the "
                        "last ~tens of tokens, L times the token (0: none)")
    p.add_argument("--experts", default=None, choices=["bf16", "fp8", "mxfp4"],
                   help="random sizes: write the weights as quantized releases ship them: fp8 (linear weights in e4m3 "
                        "with 128x128-block scales, as DeepSeek-V3; 32x32 for tiny) or mxfp4 (fused routed experts, as "
                        "gpt-oss); for --arch deepseek_v4, its releases' spelling: mxfp4 (V4-Flash: FP4 experts, FP8 "
                        "linears with ue8m0 scales) or fp8 (V4-Flash-Base) (default: mxfp4 for --arch gpt_oss, as "
                        "released; bf16 otherwise)")
    p.add_argument("--gguf", default=None, metavar="TYPE", choices=GGUF_EXPORT_TYPES, type=str.lower,
                   help="random sizes, with --no-engram: also write DIR/model-TYPE.gguf for llama.cpp, the same weights "
                        "with routed experts in TYPE (either case): bf16, q8_0, q6_k, q5_k, q4_k, q2_k, or q4_k_m (llama.cpp's "
                        "Q4_K_M: down Q6_K on some layers); everything else bf16 (norms, routers f32). K-quants need "
                        "rows of 256: tiny takes bf16 and q8_0")
    p.set_defaults(func=_cmd_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `strata` console script: runs one command, returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(only=command_in(argv) or "").parse_args(argv)
    try:
        return args.func(args)
    except StrataError as e:
        _print_error(str(e))
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`strata generate ... | head`): stop quietly, as `cat` would
        # stdout's buffer is flushed again at exit; pointing it at /dev/null keeps that from raising once more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

"""The `strata` command line as a user meets it: version, help, argument errors, and what reaches the terminal."""

from __future__ import annotations

import argparse
import io
import os
import pty
import random
import signal
import subprocess
import sys
import tty
from importlib.metadata import version

import pytest

import strata
from strata.cli import build_parser, main, terminal_safe
from strata.runtime.generation.text.tokenizer import StreamDecoder, Tokenizer

# What a terminal acts on: C0 controls but tab and newline, DEL, C1 controls.
TERMINAL_CONTROLS = frozenset([*(c for c in range(0x20) if c not in (0x09, 0x0A)), 0x7F, *range(0x80, 0xA0)])
# Screen clear, a C1 CSI (U+009B) colour sequence and a carriage return; the text the prompt echo must defuse.
HOSTILE_PROMPT = "Hi\x1b[2J\x9b31m\rthere"
# Near-uniform sampling over the tiny demo model's byte-level vocabulary: control bytes among 64 tokens.
SAMPLED = dict(max_tokens=64, temperature=100.0, seed=3)
SAMPLED_ARGS = ["--max-tokens", "64", "--temperature", "100", "--seed", "3", "--device", "cpu"]


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _controls_in(text: str) -> list[str]:
    return [c for c in text if ord(c) in TERMINAL_CONTROLS]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


# ------------------------------------------------------------------------------------ version, help, usage


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"strata {version('strata-moe')}\n"
    assert strata.__version__ == version("strata-moe")


def test_version_and_help_do_not_import_torch():
    script = (
        "import sys\n"
        "from strata.cli import main\n"
        "for argv in (['--version'], ['--help'], ['generate', '--help'], ['inspect', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]"
    assert "usage: strata generate" in r.stdout  # the help really was printed, in the same process


def test_serve_and_plan_keep_their_arguments():
    """Their arguments are added lazily; on their own command line (and in the full parser) they are all there."""
    for command, argv in (("serve", ["serve", "m", "--port", "9000"]), ("plan", ["plan", "m", "--json"])):
        for parser in (build_parser(), build_parser(only=command)):
            args = parser.parse_args(argv)
            assert args.model == "m" and (args.port == 9000 if command == "serve" else args.json)


@pytest.mark.parametrize("command", list(_subcommands(build_parser())))
def test_every_argument_has_help(command):
    sub = _subcommands(build_parser())[command]
    missing = [a.dest for a in sub._actions if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"{command}: {missing} have no help"


def test_generate_help_gives_every_default():
    sub = _subcommands(build_parser())["generate"]
    text = sub.format_help()
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "%(default)s" in action.help, action.dest
    for shown in ("(default: 64)", "(default: 0.0)", "(default: 1.0)", "(default: 0)", "(default: auto"):
        assert shown in " ".join(text.split()), shown


def test_no_arguments_prints_usage_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: strata") and "required: COMMAND" in err


def test_unknown_command_is_one_line(capsys):
    for argv, expected in ((["genrate", "--prompt", "x"], "did you mean 'generate'?"),
                           (["frobnicate"], "commands: inspect, generate, serve, plan, convert, verify, demo-model")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == f"strata: error: unknown command {argv[0]!r}; {expected}\n"


# --------------------------------------------------------------------------------- sampling options


@pytest.mark.parametrize("option, value, field", [
    ("--temperature", "-1", "temperature"), ("--temperature", "nan", "temperature"),
    ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"), ("--top-k", "-1", "top_k"),
    ("--max-tokens", "0", "max_tokens"), ("--stop", "", "stop"),
])
def test_bad_sampling_value_fails_before_echo_and_load(capfd, tmp_path, option, value, field):
    # The model directory does not exist: had it been loaded first, the error would name the checkpoint.
    argv = ["generate", str(tmp_path / "absent"), "--prompt", "PROMPT", option, value]
    assert main(argv) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert err.startswith(f"strata: error: {field} must be") and err.count("\n") == 1, err


# ----------------------------------------------------------------- stdout: model text; stderr: the rest


def test_generate_writes_only_model_text_to_stdout(capfd, tiny_model_dir, tiny_engine):
    result = tiny_engine.generate(HOSTILE_PROMPT, **SAMPLED)
    text = result.text
    assert main(["generate", str(tiny_model_dir), "--prompt", HOSTILE_PROMPT, *SAMPLED_ARGS]) == 0
    out, err = capfd.readouterr()
    assert out == HOSTILE_PROMPT + text + "\n"  # a pipe gets the text as is, control characters and all
    assert _controls_in(text)  # the random-weight model really does emit them
    summary = err.strip().splitlines()[-1]
    assert summary.startswith(f"[{len(result.token_ids)} tokens, prefill ") and "tok/s" in summary
    assert summary not in out


@pytest.mark.parametrize("chat", [False, True])
def test_generate_on_a_model_without_tokenizer_is_one_line_before_any_echo(capfd, tiny_model_dir, tmp_path, chat):
    import shutil

    bare = shutil.copytree(tiny_model_dir, tmp_path / "bare", ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    code = main(["generate", str(bare), "--prompt", "Hello there", "--device", "cpu", *(["--chat"] if chat else [])])
    out, err = capfd.readouterr()
    assert code == 2 and out == ""  # nothing echoed: the prompt was refused first
    line = err.strip().splitlines()[-1]
    assert line.startswith("strata: error: ") and "no tokenizer (tokenizer.json)" in line


def test_generate_into_a_closed_pipe_stops_quietly(tiny_model_dir):
    """`strata generate ... | head -c 1`: the reader leaves early; no traceback, the status a SIGPIPE'd tool has."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata", "generate", str(tiny_model_dir), "--prompt", "Hello", *SAMPLED_ARGS],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    first = proc.stdout.read(1)
    assert first == b"H", proc.stderr.read().decode()[-3000:]  # the prompt is out: 64 tokens are still to come
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "Exception" not in err and "[64 tokens" not in err, err


# ---------------------------------------------------------------------------------------- terminals


def test_terminal_safe_escapes_exactly_the_controls():
    every = "".join(map(chr, range(0x200)))
    shown = terminal_safe(every)
    expected = "".join(
        (f"\\x{c:02x}" if c < 0x80 else f"\\u{c:04x}") if c in TERMINAL_CONTROLS else chr(c) for c in range(0x200)
    )
    assert shown == expected
    assert terminal_safe("\x1b[2J\x9b\r\n\t\ufffd€") == "\\x1b[2J\\u009b\\x0d\n\t\ufffd€"
    assert not _controls_in(terminal_safe("".join(map(chr, range(0x110000)))))


def test_generate_on_a_terminal_escapes_controls(monkeypatch, tiny_model_dir, tiny_engine):
    text = tiny_engine.generate(HOSTILE_PROMPT, **SAMPLED).text
    assert _controls_in(text)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["generate", str(tiny_model_dir), "--prompt", HOSTILE_PROMPT, *SAMPLED_ARGS]) == 0
    shown = terminal.getvalue()
    assert shown == terminal_safe(HOSTILE_PROMPT + text) + "\n"
    assert shown.startswith("Hi\\x1b[2J\\u009b31m\\x0dthere") and not _controls_in(shown)


def test_errors_on_a_terminal_escape_controls(monkeypatch, tmp_path):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    missing = tmp_path / "no\x1b]0;title\x07model"
    assert main(["inspect", str(missing)]) == 2
    shown = terminal.getvalue()
    assert shown.startswith("strata: error: ") and "\\x1b]0;title\\x07" in shown and not _controls_in(shown)


def test_generate_in_a_real_pty(tiny_model_dir, tiny_engine):
    """The whole command on a pseudo-terminal: not one control byte from the prompt or the model reaches it."""
    text = tiny_engine.generate(HOSTILE_PROMPT, **SAMPLED).text
    leader, follower = pty.openpty()
    tty.setraw(follower)  # no newline translation: the bytes read are the bytes written
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "generate", str(tiny_model_dir), "--prompt", HOSTILE_PROMPT, *SAMPLED_ARGS],
            stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE, env=env,
        )
    finally:
        os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0, err
    shown = b"".join(chunks).decode("utf-8")
    assert shown == terminal_safe(HOSTILE_PROMPT + text) + "\n"
    assert not _controls_in(shown)


# ------------------------------------------------------------------------- characters split over tokens


def test_stream_never_shows_a_split_character_as_replacement(tiny_model_dir):
    """A character whose UTF-8 bytes span tokens is held back until complete, never streamed as U+FFFD."""
    tok = Tokenizer.from_dir(tiny_model_dir)
    text = "naïve café, 你好世界 🎉🚀 — 👩‍👩‍👧 ok"
    ids = tok.encode(text, add_special_tokens=False)
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert "" in pieces[:-1]  # characters really were split across tokens
    assert not any("\ufffd" in p for p in pieces)
    # Random ids, as a random-weight model emits: the stream shows U+FFFD only where the whole decode has it.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))]
        decoder = StreamDecoder(tok)
        streamed = "".join(decoder.push(i) for i in ids) + decoder.flush()
        assert streamed == tok.decode(ids)

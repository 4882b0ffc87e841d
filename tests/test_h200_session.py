"""bench/h200_session.sh's dispatch, on CPU with nothing real run: every mode of the live script and of
bench/h200_past_sessions.sh (the finished sessions' modes, looked up from the live script's fallback) runs by name
with python3, rm and nvidia-smi stubbed (each call logged), an unknown mode fails, and the modes the script had before
the past sessions' modes moved out (commit 0978ac8) are all still there."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIVE, PAST = ROOT / "bench" / "h200_session.sh", ROOT / "bench" / "h200_past_sessions.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

# the stubs: each logs its name and arguments a line to $STUB_LOG; python3 exits with $STUB_RC (default 0)
STUBS = {
    "python3": 'echo "python3 $*" >> "$STUB_LOG"; exit "${STUB_RC:-0}"\n',
    "rm": 'echo "rm $*" >> "$STUB_LOG"\n',
    "nvidia-smi": 'echo "nvidia-smi $*" >> "$STUB_LOG"\n',
}
ARGS = {"hotpath": ("uniform",), "timeline-one": ("uniform", "split")}  # the modes that need arguments (set -u)


def modes(text: str) -> list[str]:
    """The case labels of a script's mode dispatch (two-space indented `name)` lines), the fallback `*` left out."""
    return re.findall(r"(?m)^  ([a-z0-9-]+)\)", text)


@pytest.fixture
def run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "stub.log"
    out.mkdir()

    def run(*args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        log.write_text("")
        base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out), "STUB_LOG": str(log),
                "HOGS": "0", "LANG": "C"}  # HOGS=0: thirtyfifth-b starts no background loops
        proc = subprocess.run([BASH, "bench/h200_session.sh", *args], cwd=ROOT, env={**base, **env},
                              capture_output=True, text=True, timeout=60)
        return proc, log.read_text().splitlines()

    return run


def test_no_mode_in_both_files():
    live, past = modes(LIVE.read_text()), modes(PAST.read_text())
    assert len(set(live)) == len(live) and len(set(past)) == len(past)
    assert not set(live) & set(past)


def test_every_mode_runs_by_name(run):
    failed = []
    for mode in modes(LIVE.read_text()) + modes(PAST.read_text()):
        proc, calls = run(mode, *ARGS.get(mode, ()))
        # the setup's pip install is the first python3 call: a mode that ran made more
        if "unknown mode" in proc.stderr or len([c for c in calls if c.startswith("python3")]) < 2:
            failed.append((mode, proc.returncode, proc.stderr[-300:]))
    assert not failed


def test_the_modes_before_the_move_are_all_defined():
    try:
        old = subprocess.run(["git", "show", "0978ac8:bench/h200_session.sh"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")
    assert len(modes(old)) == 105
    assert set(modes(old)) <= set(modes(LIVE.read_text())) | set(modes(PAST.read_text()))


def test_unknown_mode_fails(run):
    proc, calls = run("no-such-mode")
    assert proc.returncode == 2 and "unknown mode 'no-such-mode'" in proc.stderr
    assert len(calls) == 1  # only the setup's pip install


def test_a_past_mode_gets_its_arguments_and_runs_other_modes(run):
    # twentyfifth-b runs `bash "$0" twentyfifth "${2:-...}"` (a past mode through the live script again)
    proc, calls = run("twentyfifth-b", "split,split+again")
    assert proc.returncode == 0, proc.stderr
    assert any("hotpath-loc1" in c and "--cases split,split+again" in c for c in calls)
    # sixteenth runs `bash "$0" tests` (a live mode) and hotpath with its $2
    proc, calls = run("sixteenth", "ceiling")
    assert any("-m pytest -q -m gpu tests" in c for c in calls)
    assert any("bench/hotpath.py" in c and "--cases ceiling" in c for c in calls)


@pytest.mark.parametrize("rc", ["3", "2"])
def test_a_past_mode_exits_with_its_last_commands_status(run, rc):
    # thirtythird-b ends with `... || timeout 150 python3 bench/serial_phase.py ...`: its status is the mode's, 2 too
    # (2 is also what past_session_mode returns for an unknown mode; that one alone says "unknown mode")
    proc, _ = run("thirtythird-b", STUB_RC=rc)
    assert proc.returncode == int(rc)
    assert "unknown mode" not in proc.stderr


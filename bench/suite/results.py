"""The suite's JSON: the machine, the rates, the models, one record per case; validated and merged.

Every case record has `name`, `variant`, `routing`, `budget`, `workload`, `group`, `status`
("ok" | "skipped" | "error"), `reason` (why not ok) and, when ok, `metrics` and `roofline`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

SCHEMA = "strata-bench-suite/1"
STATUSES = ("ok", "skipped", "error")
# metrics every ok strata case reports (None where it does not apply, e.g. hit rate without tiers)
METRICS = ("decode_tok_s", "slowest_stream_tok_s", "prefill_tok_s", "ttft_s", "gpu_hit_rate", "bytes_per_token",
           "cpu_experts_per_token", "stall_s_per_token", "peak_vram_bytes", "peak_rss_bytes", "tokens")
RESULT_FILE = "suite.json"


def machine_info() -> dict:
    """GPU, driver, CPU, RAM, library versions and the git commit of this checkout."""
    import psutil
    import torch

    import strata

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "strata": strata.__version__,
        "cpu": cpu_model(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpu_threads": psutil.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "gpu": None,
        "gpu_memory_bytes": None,
        "driver": _nvidia_smi("driver_version"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    # a copy of a tree whose git metadata is not its own (the GPU box's working-tree copy): the caller names the
    # commit it copied, e.g. STRATA_BENCH_COMMIT=$(git rev-parse HEAD) written into the remote command
    if given := os.environ.get("STRATA_BENCH_COMMIT"):
        info["git_commit"], info["git_dirty"], info["git_commit_from"] = given, False, "STRATA_BENCH_COMMIT"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"], info["gpu_memory_bytes"] = p.name, p.total_memory
        info["gpu_count"] = torch.cuda.device_count()
    for mod in ("transformers", "accelerate", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as missing
            info[mod] = None
    return info


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def new_document(suite: str, settings: dict, machine: dict, rates: dict) -> dict:
    return {"schema": SCHEMA, "suite": suite, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": machine, "settings": settings, "rates": rates, "models": {}, "cases": []}


def write(doc: dict, out_dir: str | os.PathLike) -> Path:
    """Write (atomically: a kill mid-write leaves the previous file) and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def validate(doc: dict) -> list[str]:
    """Problems with a result document (empty when it is valid)."""
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    for key in ("machine", "settings", "rates", "models", "cases"):
        if key not in doc:
            problems.append(f"missing key {key!r}")
    for i, case in enumerate(doc.get("cases", [])):
        where = f"case {i} ({case.get('name', '?')})"
        for key in ("name", "variant", "routing", "budget", "workload", "group", "status"):
            if key not in case:
                problems.append(f"{where}: missing {key!r}")
        status = case.get("status")
        if status not in STATUSES:
            problems.append(f"{where}: status {status!r} not in {STATUSES}")
        elif status != "ok" and not case.get("reason"):
            problems.append(f"{where}: {status} without a reason")
        elif status == "ok":
            metrics = case.get("metrics") or {}
            missing = [m for m in METRICS if m not in metrics] if case.get("variant") not in ("hf", "serve") else []
            if missing:
                problems.append(f"{where}: metrics missing {missing}")
            if case.get("variant") == "serve" and "ready_s" not in metrics:
                problems.append(f"{where}: serve case without ready_s")
            tok = metrics.get("decode_tok_s")
            if case.get("variant") != "serve" and not (isinstance(tok, int | float) and tok > 0):
                problems.append(f"{where}: decode_tok_s {tok!r} is not a positive number")
    return problems


def depth(doc: dict) -> int | None:
    """The layer count of a result document's checkpoints (the deepest of its routings; None when unrecorded)."""
    layers = [m.get("layers") for m in (doc.get("models") or {}).values() if isinstance(m, dict) and m.get("layers")]
    return max(layers) if layers else None


def depth_suffix(layers: int) -> str:
    """What `load` appends to the names of a run's cases whose checkpoints are `layers` deep, where the first
    run's are not ("@24L")."""
    return f"@{layers}L"


def case_depth(name: str) -> int | None:
    """The layer count a merged case name carries (`depth_suffix`: "...@24L" -> 24), None for the reference depth's."""
    _, at, tail = name.rpartition("@")
    return int(tail[:-1]) if at and tail.endswith("L") and tail[:-1].isdigit() else None


def run_label(i: int) -> str:
    """The i-th run's label, as spreadsheet columns go: A..Z, then AA, AB, ..."""
    label = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        label = chr(ord("A") + r) + label
    return label


def load(paths: list[str | os.PathLike]) -> dict:
    """Read one or more result files into one document: later files' cases replace earlier ones of the
    same name, except that a case a later run skipped or failed leaves an earlier measurement in place (a box
    that lacked a package says nothing about the figure); machine, rates and settings come from the last file at
    the document's depth (below). Each case keeps its run's label ("A" for the first file, ...) in `run`; `runs`
    lists the files and `by_run` every run's own cases, so that ratios can be taken within one run
    (`cells.pair`).

    The first file's checkpoint depth is the document's (`models`). A run on checkpoints of another depth (the
    full 48-layer model where the others cut it to 12) keeps its cases apart: their names get "@{layers}L"
    appended, and its checkpoints are listed under `models_at[layers]`."""
    merged: dict | None = None
    cases: dict[str, dict] = {}
    by_run: dict[str, dict[str, dict]] = {}  # run label -> that run's cases by name (ratios come from one run)
    runs: list[dict] = []
    models: dict = {}
    models_at: dict[int, dict] = {}
    ref: int | None = None
    for i, p in enumerate(paths):
        doc = json.loads(Path(p).read_text())
        problems = validate(doc)
        if problems:
            raise ValueError(f"{p}: not a valid suite result: {problems[0]}")
        label = run_label(i)
        n = depth(doc)
        ref = ref if ref is not None else n
        suffix = depth_suffix(n) if n is not None and ref is not None and n != ref else ""
        runs.append({"label": label, "started": doc.get("started"), "source": str(p),
                     "commit": str((doc.get("machine") or {}).get("git_commit"))[:10],
                     **({"layers": n} if suffix else {})})
        for c in doc["cases"]:
            c = {**c, "name": c["name"] + suffix} if suffix else c
            c.setdefault("run", label)
            if c["status"] == "ok" or cases.get(c["name"], {}).get("status") != "ok":
                cases[c["name"]] = c
            by_run.setdefault(c["run"], {})[c["name"]] = c
        if suffix:
            models_at[n] = {**models_at.get(n, {}), **doc.get("models", {})}
        else:
            models = {**models, **doc.get("models", {})}
            merged = doc
    if merged is None:
        raise ValueError("no result files given")
    merged = {**merged, "models": models, "cases": list(cases.values()), "runs": runs, "by_run": by_run}
    if models_at:
        merged["models_at"] = models_at
    return merged

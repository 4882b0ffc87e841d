"""The `llamacpp` baseline: llama.cpp's own benchmark tools on the suite's checkpoint exported as GGUF.

The same weights: the suite's demo checkpoint exported as a bf16 GGUF (variant `llamacpp`) or with its routed
experts in Q4_K_M (`llamacpp-q4_k_m`) by strata.tiers.store.gguf_export (`gguf_path`: on disk, written once). The
same GPU budget, as closely as llama.cpp allows (`expert_placement`): every layer on the GPU (`-ngl 99`) except the
routed experts of the first N layers, which stay in RAM and run on the CPU threads (`--n-cpu-moe N`), and, where the
budget has room for part of layer N-1's expert tensors (its gate, up and down stacks), those on the GPU too: the
tool then gets `--n-cpu-moe N-1` and `-ot` sends the rest of that layer's stacks to the CPU. Flash attention on,
`-t` = the machine's physical cores. This llama.cpp has no GPU expert cache (only expert stacks placed by -ncmoe /
-ot), so that placement is its only row.

- decode (workloads pNxS): `llama-batched-bench -npp N -ntg T -npl 1,4,8` (its table): S sequences, each with its own N-token
  prompt decoded as one batch, then T steps of one token per sequence as one batch (llama.cpp's batching, what
  llama-server's parallel slots do). decode_tok_s = S*T over the decode time (all streams, as strata's figure).
- prefill (p512x1, p8192x1): `llama-bench -p N -n 0 -r R -o json`, its mean tok/s over R repetitions on an empty
  KV cache; the decode after that prompt comes from batched-bench at that prompt length (one stream).

One group (variant, routing, budget) runs each tool once for all its workloads and splits the output into the
cases' records.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

from bench.suite.case_config import prefill_chunk
from bench.suite.cases import Case
from bench.suite.strata_case import record

GGUF_OF_VARIANT = {"llamacpp": "bf16", "llamacpp-q4_k_m": "q4_k_m"}
EXPS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")  # llama.cpp's LLM_FFN_EXPS_REGEX
PREFILL_PROMPTS = (512, 8192)  # one-stream workloads whose prefill llama-bench measures


def expert_tensor_bytes(gguf_path: str | os.PathLike) -> dict[int, dict[str, int]]:
    """Routed-expert tensors per layer index of a GGUF, {layer: {tensor name: bytes}} (the tensors --n-cpu-moe and
    -ot move: blk.L.ffn_{gate,up,down}_exps.weight, each a stack of every expert's matrix)."""
    from gguf import GGUFReader

    out: dict[int, dict[str, int]] = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        m = EXPS.match(t.name)
        if m:
            out.setdefault(int(m.group(1)), {})[t.name] = int(t.n_bytes)
    return out


def layer_expert_bytes(gguf_path: str | os.PathLike) -> dict[int, int]:
    """Routed-expert bytes per layer index of a GGUF (the sums of `expert_tensor_bytes`)."""
    return {layer: sum(t.values()) for layer, t in expert_tensor_bytes(gguf_path).items()}


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp keeps the routed experts: the stacks of layers 0..n_cpu_moe-1 and `cpu_tensors` (stacks of
    layer n_cpu_moe) in RAM, computed by the CPU threads; every other stack on the GPU, `gpu_bytes` in all."""

    n_cpu_moe: int
    cpu_tensors: tuple[str, ...]
    gpu_bytes: int

    def args(self) -> list[str]:
        """The tools' flags: -ncmoe, and -ot with one regex for `cpu_tensors` (no ',' or ';', which both tools
        take as list separators)."""
        out = ["-ncmoe", str(self.n_cpu_moe)]
        if self.cpu_tensors:
            out += ["-ot", "|".join("^" + re.escape(t) + "$" for t in self.cpu_tensors) + "=CPU"]
        return out

    @property
    def label(self) -> str:
        """-ncmoe N, and the stacks -ot moves (e.g. "9 + blk.9 up"), for the report."""
        short = [re.sub(r"^blk\.(\d+)\.ffn_(\w+?)_(ch)?exps.*", r"\2", t) for t in self.cpu_tensors]
        return str(self.n_cpu_moe) + (f" + blk.{self.n_cpu_moe} {'/'.join(short)}" if short else "")


def expert_placement(tensors: dict[int, dict[str, int]], num_layers: int, gpu_fraction: float | None) -> Placement:
    """llama.cpp's placement for strata's budget of `gpu_fraction` of the expert bytes. The budget is B = fraction
    x (the GGUF's expert bytes: bf16, or Q4_K_M when the export is, so both engines get the same share of their own
    weights). --n-cpu-moe N keeps the stacks of layers 0..N-1 (every layer index, dense ones included) in RAM, so
    the GPU takes the most whole layers from the last one down that fit in B; then, of the next layer down, the
    subset of its stacks with the most bytes that fits what is left (they go to the GPU, N drops by one and -ot
    keeps that layer's other stacks in RAM). Never more than B. E.g. 12 equal layers of E bytes at 25%: B = 3E, N =
    9. 12 layers of stacks gate 2u, up 2u, down 3u, the last two layers' down 4u (Q4_K_M gives some layers' down
    more bits), at 25% (B = 21.5u): layers 10 and 11 whole (16u), then layer 9's down and gate (5u), so -ncmoe 9
    -ot <layer 9's up>=CPU, 21u on the GPU. None (all in VRAM): N = 0."""
    total = sum(sum(t.values()) for t in tensors.values())
    if gpu_fraction is None:
        return Placement(0, (), total)
    budget = gpu_fraction * total * (1 + 1e-9)  # a budget of exactly k layers is k layers, not k-1 from rounding
    on_gpu, n = 0, num_layers
    for layer in range(num_layers - 1, -1, -1):
        size = sum(tensors.get(layer, {}).values())
        if on_gpu + size > budget:
            break
        on_gpu += size
        n = layer
    stacks = tensors.get(n - 1, {}) if n > 0 else {}
    names = sorted(stacks)
    subsets = (c for r in range(1, len(names)) for c in itertools.combinations(names, r))  # proper, non-empty
    fitting = ((sum(stacks[t] for t in c), c) for c in subsets)
    size, chosen = max((f for f in fitting if on_gpu + f[0] <= budget), key=lambda f: f[0], default=(0, ()))
    if not chosen:
        return Placement(n, (), on_gpu)
    return Placement(n - 1, tuple(t for t in names if t not in chosen), on_gpu + size)


def gguf_path(model: Path, export: str, settings: dict) -> Path:
    """Where a checkpoint's GGUF export is kept: on disk under the llama.cpp root (not beside the checkpoint, in
    /dev/shm, where its ~1.1x the checkpoint's bytes would be RAM the pinned tier lacks), one per checkpoint and type."""
    from bench.suite.llamacpp_build import default_root

    root = Path(settings["llamacpp_root"]).expanduser() if settings.get("llamacpp_root") else default_root()
    return root / "gguf" / f"{Path(model).name}-{export}.gguf"


def ensure_gguf(model: Path, export: str, settings: dict, log=None) -> Path:
    """The GGUF of checkpoint `model` with its routed experts in `export` (written once: a file that exists is
    whole, write_gguf renames it into place), the one file both llama.cpp's and strata's cases of that export read.
    `log` is told, with the path, when the file is not on disk yet and is being exported."""
    from strata.tiers.store.gguf_export import write_gguf

    path = gguf_path(model, export, settings)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # a bf16 export is ~ the checkpoint's bytes (16 GB for 12 bench layers): where the disk lacks room for it,
        # the other exports go first (each serves one variant and routing; a later run writes it again)
        need = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) + (2 << 30)
        for other in sorted(path.parent.glob("*.gguf"), key=lambda f: f.stat().st_mtime):
            if shutil.disk_usage(path.parent).free >= need:
                break
            other.unlink()
        if log is not None:
            log(f"exporting {model} as a GGUF with its routed experts in {export}: {path} (not on disk yet)")
        write_gguf(model, path, experts=export)
    return path


def physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def common_args(gguf: Path, placement: Placement, threads: int) -> list[str]:
    """Placement, threads and loading, shared by both tools (flash attention is spelled differently by each).
    `-lm none` reads the weights instead of mapping the file, as llama.cpp's loader advises when tensors are
    overridden to the CPU: its RAM-resident experts then sit in pinned host buffers, from which a batch of 32+
    tokens copies them to the GPU at the link's full rate (mapped pages copy at a fraction of it)."""
    return ["-m", str(gguf), "-ngl", "99", *placement.args(), "-t", str(threads), "-lm", "none"]


def batched_bench_cmd(tool: Path, gguf: Path, placement: Placement, threads: int, prompts: list[int], tokens: int,
                      streams: list[int], batch: int) -> list[str]:
    """`batch`: -b and -ub, strata's prefill chunk for these prompts (`case_config.prefill_chunk`), so that both
    engines move each RAM-resident expert to the GPU once a chunk (llama.cpp copies them once a micro-batch; its
    default is 512)."""
    ctx = max(streams) * (max(prompts) + tokens) + 64  # every sequence its own prompt and tokens (not shared)
    return [str(tool), *common_args(gguf, placement, threads), "-fa", "on", "-c", str(ctx), "-b", str(batch),
            "-ub", str(batch), "-npp", ",".join(map(str, prompts)), "-ntg", str(tokens),
            "-npl", ",".join(map(str, streams)), "-lv", "4"]  # its table (the jsonl output loses its last row);
    # -lv 4: its buffer sizes (parse_buffers)


def llama_bench_cmd(tool: Path, gguf: Path, placement: Placement, threads: int, prompts: list[int],
                    repetitions: int, batch: int) -> list[str]:
    """`batch`: -b and -ub, as `batched_bench_cmd`'s."""
    return [str(tool), *common_args(gguf, placement, threads), "-fa", "1", "-b", str(batch), "-ub", str(batch),
            "-p", ",".join(map(str, prompts)), "-n", "0", "-r", str(repetitions), "-o", "json"]


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's rows: {pp, tg, pl, t_pp, speed_pp, t_tg, speed_tg}, from its jsonl lines
    (--output-format jsonl) or, failing those, from its markdown table (what the suite reads: in this llama.cpp the
    jsonl output drops its last row, the one of the most streams, at exit; the table keeps every row)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            d = json.loads(line)
            rows.append({k: d[k] for k in ("pp", "tg", "pl", "t_pp", "speed_pp", "t_tg", "speed_tg")})
    if rows:
        return rows
    for line in text.splitlines():  # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            pp, tg, pl = int(cells[0]), int(cells[1]), int(cells[2])
            rows.append({"pp": pp, "tg": tg, "pl": pl, "t_pp": float(cells[4]), "speed_pp": float(cells[5]),
                         "t_tg": float(cells[6]), "speed_tg": float(cells[7])})
    return rows


BUFFER = re.compile(r"\s(\S+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")


def parse_buffers(text: str) -> dict[str, dict[str, int]]:
    """llama.cpp's buffer lines at log verbosity 4 (`-lv 4`): {buffer name: {model|KV|compute|output: bytes}}, e.g.
    CUDA0 (VRAM), CUDA_Host (pinned RAM), CPU_Mapped (the mmapped GGUF), CPU."""
    out: dict[str, dict[str, int]] = {}
    for name, kind, mib in BUFFER.findall(text):
        out.setdefault(name, {})[kind] = out.get(name, {}).get(kind, 0) + round(float(mib) * 2**20)
    return out


def gpu_buffer_bytes(buffers: dict[str, dict[str, int]]) -> int | None:
    """VRAM llama.cpp allocated: its CUDA devices' model, KV, compute and output buffers (None without a GPU)."""
    gpu = [sum(kinds.values()) for name, kinds in buffers.items() if re.fullmatch(r"CUDA\d+", name)]
    return sum(gpu) if gpu else None


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench -o json: one object per test, {n_prompt, n_gen, avg_ts, stddev_ts, n_cpu_moe, ...}."""
    start = text.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array (was it run with -o json?)")
    return json.loads(text[start:text.rfind("]") + 1])


def _run(cmd: list[str], timeout: float, log) -> str:
    log("llama.cpp: " + " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout))
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}: {tail}")
    return done.stdout + "\n" + done.stderr


def _metrics(decode: dict | None, prefill: dict | None, prompt: int) -> dict:
    """A record's metrics from a batched-bench row (decode) and a llama-bench test (prefill)."""
    nulls = {"gpu_hit_rate": None, "bytes_per_token": {}, "cpu_experts_per_token": None, "stall_s_per_token": None,
             "peak_vram_bytes": None, "peak_rss_bytes": None}
    m = {"decode_tok_s": None, "slowest_stream_tok_s": None, "prefill_tok_s": None, "ttft_s": None, "tokens": None,
         **nulls}
    if decode:
        pl = decode["pl"]
        m.update(decode_tok_s=round(decode["speed_tg"], 3), slowest_stream_tok_s=round(decode["speed_tg"] / pl, 3),
                 prefill_tok_s=round(decode["speed_pp"], 2), ttft_s=round(decode["t_pp"], 4), tokens=decode["tg"])
        buffers = decode.get("buffers") or {}
        # peak VRAM: what llama.cpp allocated on the GPU for that run (its CUDA buffers; the CUDA context not counted)
        m.update(peak_vram_bytes=gpu_buffer_bytes(buffers), llamacpp_buffers=buffers,
                 kv_reserved_bytes=gpu_buffer_bytes({k: {"KV": v.get("KV", 0)} for k, v in buffers.items()}))
    if prefill:  # llama-bench's mean over its repetitions replaces the one batched-bench prefill
        m.update(prefill_tok_s=round(prefill["avg_ts"], 2), ttft_s=round(prompt / prefill["avg_ts"], 4),
                 prefill_stddev_tok_s=round(prefill.get("stddev_ts", 0.0), 2))
    return m


def run_llamacpp_group(group: list[Case], model: Path, tools: dict[str, Path], settings: dict, limit_s: float,
                       log=print) -> list[dict]:
    """Records for one group of llamacpp cases (one variant, routing and budget), each tool run once."""
    first = group[0]
    export = GGUF_OF_VARIANT[first.variant]
    t0 = time.perf_counter()
    gguf = ensure_gguf(model, export, settings, log)
    export_s = time.perf_counter() - t0
    stacks = expert_tensor_bytes(gguf)
    total = sum(sum(t.values()) for t in stacks.values())
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    num_layers = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    placement = expert_placement(stacks, num_layers, first.gpu_fraction)
    threads = int(settings.get("llamacpp_threads") or physical_cores())
    token_budget = int(settings.get("token_budget", 2048))
    config = {"gguf": str(gguf), "experts": export, "n_cpu_moe": placement.n_cpu_moe,
              "cpu_tensors": list(placement.cpu_tensors), "placement": placement.label,
              "gpu_expert_bytes": placement.gpu_bytes, "expert_bytes_total": total, "threads": threads,
              "flash_attn": True, "n_gpu_layers": 99, "tools": {k: str(v) for k, v in tools.items()}}
    log(f"{first.variant}/{first.budget_label}/{first.routing}: {gguf.name}, {' '.join(placement.args())} of "
        f"{num_layers} layers ({placement.gpu_bytes / 1e9:.2f} of {total / 1e9:.2f} GB of experts on the GPU), "
        f"-t {threads}")
    deadline = time.perf_counter() + limit_s
    decode_rows: dict[tuple[int, int], dict] = {}
    by_prompt: dict[int, list[int]] = {}
    tokens: dict[int, int] = {}
    for c in group:
        by_prompt.setdefault(c.workload.prompt, []).append(c.workload.streams)
        tokens[c.workload.prompt] = max(tokens.get(c.workload.prompt, 0), c.workload.tokens)
    for prompt, streams in sorted(by_prompt.items()):  # one batched-bench run per prompt length
        out = _run(batched_bench_cmd(tools["llama-batched-bench"], gguf, placement, threads, [prompt],
                                     tokens[prompt], sorted(set(streams)), prefill_chunk([prompt], token_budget)),
                   deadline - time.perf_counter(), log)
        buffers = parse_buffers(out)
        for row in parse_batched_bench(out):
            decode_rows[(row["pp"], row["pl"])] = {**row, "buffers": buffers}
    prefill_rows: dict[int, dict] = {}
    prefill = sorted(p for p, s in by_prompt.items() if p in PREFILL_PROMPTS and 1 in s)
    if prefill:
        out = _run(llama_bench_cmd(tools["llama-bench"], gguf, placement, threads, prefill,
                                   int(settings.get("llamacpp_repetitions", 3)), prefill_chunk(prefill, token_budget)),
                   deadline - time.perf_counter(), log)
        prefill_rows = {t["n_prompt"]: t for t in parse_llama_bench(out) if t.get("n_gen", 0) == 0}
    recs = []
    for c in group:
        w = c.workload
        row = decode_rows.get((w.prompt, w.streams))
        if row is None:
            recs.append(record(c, "error", f"llama-batched-bench printed no row for {w.prompt} tokens x {w.streams}"))
            continue
        metrics = _metrics(row, prefill_rows.get(w.prompt) if w.streams == 1 else None, w.prompt)
        recs.append(record(c, "ok", None, metrics=metrics, roofline=None, fraction_of_roofline=None,
                           config={**config, "gguf_export_s": round(export_s, 1)}))
        log(f"{c.name}: decode {metrics['decode_tok_s']} tok/s, prefill {metrics['prefill_tok_s']} tok/s")
    return recs


def start_llamacpp(settings: dict, log=print) -> Future:
    """Find or build (in the background) the tools the llamacpp cases run (bench.suite.llamacpp_build)."""
    from bench.suite.llamacpp_build import start_tools

    return start_tools(settings.get("llamacpp_bin"), settings.get("llamacpp_src"), settings.get("llamacpp_root"), log)


def run_llamacpp_cases(group: list[Case], model: Path, tools: Future | None, settings: dict, limit_s: float,
                       log=print) -> list[dict]:
    """A group's records: skipped (with the reason) when the checkpoint cannot be exported or the tools are not
    there in time, else `run_llamacpp_group`."""
    from bench.suite.llamacpp_build import LlamaCppBuildError

    if settings.get("experts", "bf16") != "bf16":
        return [record(c, "skipped", f"the GGUF export starts from bf16 checkpoints, not {settings['experts']}")
                for c in group]
    t0 = time.perf_counter()
    try:
        if tools is None:
            raise LlamaCppBuildError("no llama.cpp tools were looked for")
        found = tools.result(timeout=max(1.0, limit_s - 60))  # the build may still run: leave a minute to measure
    except FutureTimeout:
        return [record(c, "skipped", "llama.cpp's tools were still building at the suite's deadline (the build "
                                     "continues from where it stopped on the next run)") for c in group]
    except LlamaCppBuildError as e:
        return [record(c, "skipped", str(e)) for c in group]
    return run_llamacpp_group(group, model, found, settings, limit_s - (time.perf_counter() - t0), log)

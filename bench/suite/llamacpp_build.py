"""llama.cpp's benchmark tools built from the source llama-cpp-python vendors, for the suite's `llamacpp` baseline.

The llama-cpp-python sdist (bench/cpu/cpu_vs_llamacpp.py pins its version) carries llama.cpp in vendor/llama.cpp.
`prepare_source` copies that tree out of the sdist without what no build needs (docs, vocab models, tests,
examples, the web UI: ~176 MB down to the part cmake reads), so that it can travel to a machine without internet
as an ignored path (bench/gpu_run.sh `wheels` writes it to .gpu/llama.cpp-src). `build_tools` configures it with
the suite's flags (CUDA for sm_90 where nvcc and a GPU are present, else the CPU backend; native CPU code;
static binaries) and builds only the tools the baseline runs, in a build directory keyed by the source's hash, so
a second call with the same source finds them and builds nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

TOOLS = ("llama-bench", "llama-batched-bench")  # prefill and one-stream decode; decode of 1/4/8 parallel streams
# top-level parts of vendor/llama.cpp that no build of the tools reads
# (and ggml's backends other than the CPU's and CUDA's: cmake adds a backend's directory only when it is enabled)
STRIPPED = ("docs", "models", "media", "tests", "examples", "benches", "gguf-py", "conversion", ".github",
            "tools/ui", "tools/server/webui", "tools/server/tests",
            *(f"ggml/src/ggml-{b}" for b in ("cann", "et", "hexagon", "metal", "musa", "opencl", "openvino", "sycl",
                                              "virtgpu", "vulkan", "webgpu", "zdnn", "zendnn")))
HASH_FILE = ".strata-source-sha256"
CMAKE_COMMON = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")
CMAKE_CUDA = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90")


class LlamaCppBuildError(RuntimeError):
    """llama.cpp's tools could not be prepared or built (the message names the step and what to do)."""


def _stripped(rel: str) -> bool:
    return any(rel == s or rel.startswith(s + "/") for s in STRIPPED)


def prepare_source(origin: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """llama.cpp's source at `dest`, from `origin`: a llama-cpp-python sdist (.tar.gz), a `pack_source`
    archive, an extracted sdist (with vendor/llama.cpp) or a llama.cpp tree; the parts in STRIPPED left out. Reused when `dest` already holds
    a prepared tree (its hash file written last, so a half-written copy is never reused)."""
    origin, dest = Path(origin), Path(dest)
    if (dest / HASH_FILE).is_file():
        return dest
    if not origin.exists():
        raise LlamaCppBuildError(f"no llama.cpp source at {origin}; give the llama-cpp-python sdist (.tar.gz) or "
                                 "an extracted llama.cpp tree")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if origin.is_file():
        _extract_vendored(origin, tmp)
    else:
        root = origin / "vendor" / "llama.cpp" if (origin / "vendor" / "llama.cpp").is_dir() else origin
        if not (root / "CMakeLists.txt").is_file() or not (root / "ggml").is_dir():
            raise LlamaCppBuildError(f"{origin} is neither a llama.cpp tree nor an extracted llama-cpp-python sdist")
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if _stripped(rel) or not path.is_file() or path.is_symlink():
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, tmp / rel)
    (tmp / HASH_FILE).write_text(source_hash(tmp) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _extract_vendored(archive: Path, dest: Path) -> None:
    """The llama.cpp tree of a .tar.gz into dest, without the stripped parts: vendor/llama.cpp of a
    llama-cpp-python sdist (<name>-<version>/vendor/llama.cpp/...), or a tree packed by `pack_source`
    (llama.cpp/...)."""
    with tarfile.open(archive, "r:gz") as tar:
        found = False
        for member in tar:
            parts = member.name.split("/")
            if len(parts) >= 4 and parts[1:3] == ["vendor", "llama.cpp"]:
                rel = "/".join(parts[3:])
            elif len(parts) >= 2 and parts[0] == "llama.cpp":
                rel = "/".join(parts[1:])
            else:
                continue
            if not member.isfile():
                continue
            if _stripped(rel) or ".." in parts:
                continue
            found = True
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(target, member.mode & 0o755 | 0o600)
    if not found:
        raise LlamaCppBuildError(f"{archive} holds no vendor/llama.cpp; give the llama-cpp-python sdist")


def pack_source(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A prepared tree as one .tar.gz (members llama.cpp/...; ~8 MB), the form that travels to the GPU machine;
    `prepare_source(out, dest)` unpacks it there."""
    src, out = Path(src), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(p for p in src.rglob("*") if p.is_file() and p.name != HASH_FILE):
            tar.add(path, arcname="llama.cpp/" + path.relative_to(src).as_posix())
    os.replace(tmp, out)
    return out


def source_hash(src: str | os.PathLike) -> str:
    """sha256 over the tree's relative paths and contents (the hash file itself excluded)."""
    h = hashlib.sha256()
    root = Path(src)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != HASH_FILE):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def cuda_available() -> bool:
    """Whether a CUDA build makes sense here: nvcc on PATH and a GPU that nvidia-smi lists (a CPU host with the
    toolkit installed builds the CPU tools: a CUDA build there takes far longer and its tools cannot run)."""
    if shutil.which("nvcc") is None or shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def cmake_args(cuda: bool, cublas: list[str] | None = None) -> list[str]:
    """The configure flags: the common ones, plus CUDA for sm_90 (H100/H200) when `cuda`, plus `cublas` (the
    flags of `pip_cublas_args` where the toolkit has no cuBLAS of its own, and of `cuda_driver_args`)."""
    return [*CMAKE_COMMON, *((*CMAKE_CUDA, *(cublas or [])) if cuda else ("-DGGML_CUDA=OFF",))]


def toolkit_has_cublas() -> bool:
    """Whether the CUDA toolkit of the nvcc on PATH has cuBLAS's header (a toolkit put together from pip's
    nvidia-cuda-* wheels has none: cuBLAS then comes with torch's nvidia-cublas wheel)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return False
    root = Path(nvcc).resolve().parent.parent
    return any((root / sub / "cublas_v2.h").is_file() for sub in ("include", "targets/x86_64-linux/include"))


def cuda_driver_args() -> list[str]:
    """cmake flags for the CUDA driver library (libcuda), which ggml links for its VMM pool: none where the toolkit
    has its stub, the driver's own libcuda.so.1 where ldconfig knows it (a toolkit from pip's wheels has no stub),
    else the VMM pool off (-DGGML_CUDA_NO_VMM=ON: ggml's other pool; a configure-only host without a driver)."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if any((root / sub / "libcuda.so").exists() for sub in ("lib64/stubs", "targets/x86_64-linux/lib/stubs")):
            return []
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    for line in listing.splitlines():
        if line.strip().startswith("libcuda.so") and "=>" in line and "x86-64" in line:
            return [f"-DCUDA_cuda_driver_LIBRARY={line.split('=>', 1)[1].strip()}"]
    return ["-DGGML_CUDA_NO_VMM=ON"]


def pip_cublas_args(search: list[str | os.PathLike] | None = None) -> list[str]:
    """cmake flags that point llama.cpp's CUDA build at the cuBLAS of pip's nvidia wheels (the library files named
    as FindCUDAToolkit's cache entries, the header directory on nvcc's and the compiler's include path), found
    under <dir>/nvidia for each dir of `search` (default: sys.path); [] when none is there."""
    for base in search if search is not None else sys.path:
        nvidia = Path(base) / "nvidia"
        if not nvidia.is_dir():
            continue
        for header in sorted(nvidia.glob("**/include/cublas_v2.h")):
            lib = header.parent.parent / "lib"
            cublas, cublas_lt = sorted(lib.glob("libcublas.so*")), sorted(lib.glob("libcublasLt.so*"))
            if cublas and cublas_lt:
                inc = header.parent
                return [f"-DCUDA_cublas_LIBRARY={cublas[-1]}", f"-DCUDA_cublasLt_LIBRARY={cublas_lt[-1]}",
                        f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]
    return []


def build_dir_for(src: str | os.PathLike, build_root: str | os.PathLike, cuda: bool) -> Path:
    """The build directory of a prepared source: <build_root>/<hash[:16]>-<cuda|cpu>."""
    src = Path(src)
    digest = (src / HASH_FILE).read_text().strip() if (src / HASH_FILE).is_file() else source_hash(src)
    return Path(build_root) / f"{digest[:16]}-{'cuda' if cuda else 'cpu'}"


def tool_paths(build: Path, tools: tuple[str, ...] = TOOLS) -> dict[str, Path]:
    return {t: build / "bin" / t for t in tools}


def build_tools(src: str | os.PathLike, build_root: str | os.PathLike, tools: tuple[str, ...] = TOOLS,
                cuda: bool | None = None, jobs: int | None = None, log=print, nice: int = 0) -> dict[str, Path]:
    """Build `tools` from the llama.cpp tree `src` (see `prepare_source`) and return tool -> binary. Nothing is
    built when the build directory for this source and backend already has them. `cuda` None: `cuda_available()`.
    `jobs`: parallel compiles (default: the machine's cores). `nice`: added to the compilers' niceness (a build beside
    running benchmarks), on top of the caller's, which they inherit."""
    src = Path(src)
    cuda = cuda_available() if cuda is None else cuda
    build = build_dir_for(src, build_root, cuda)
    paths = tool_paths(build, tools)
    if all(p.is_file() for p in paths.values()):
        return paths
    if shutil.which("cmake") is None:
        raise LlamaCppBuildError("cmake is not installed; install cmake (and a C++ compiler) to build llama.cpp")
    build.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cublas = pip_cublas_args() if cuda and not toolkit_has_cublas() else []
    if cublas:
        log(f"llama.cpp: cuBLAS from pip's nvidia wheels ({cublas[0].split('=', 1)[1]}): the toolkit has none")
    cublas += cuda_driver_args() if cuda else []
    configure = ["cmake", "-S", str(src), "-B", str(build), *gen, *cmake_args(cuda, cublas)]
    compile_ = ["cmake", "--build", str(build), "-j", str(jobs or os.cpu_count() or 2), "--target", *tools]
    for what, cmd in (("configure", configure), ("build", compile_)):
        log(f"llama.cpp {what}: {' '.join(cmd)}")
        done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        (build / f"strata-{what}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise LlamaCppBuildError(f"llama.cpp {what} failed (exit {done.returncode}; {build}/strata-{what}.log): "
                                     + " | ".join(tail))
    missing = [t for t, p in paths.items() if not p.is_file()]
    if missing:
        raise LlamaCppBuildError(f"the llama.cpp build in {build} did not produce {', '.join(missing)}")
    return paths


def find_tools(tools: tuple[str, ...] = TOOLS, bin_dir: str | os.PathLike | None = None) -> dict[str, Path] | None:
    """Already built tools: in `bin_dir` (or $STRATA_LLAMACPP_BIN), else on PATH; None unless all are found."""
    bin_dir = bin_dir or os.environ.get("STRATA_LLAMACPP_BIN")
    out = {}
    for t in tools:
        p = Path(bin_dir) / t if bin_dir else (Path(w) if (w := shutil.which(t)) else None)
        if p is None or not p.is_file():
            return None
        out[t] = p
    return out


def default_root() -> Path:
    """Where prepared sources and builds are kept: $STRATA_CACHE/bench/llamacpp (~/.cache/strata/bench/llamacpp)."""
    return Path(os.environ.get("STRATA_CACHE", "~/.cache/strata")).expanduser() / "bench" / "llamacpp"


def ensure_tools(bin_dir: str | None, src: str | None, root: str | None = None, jobs: int | None = None,
                 log=print, nice: int = 0) -> dict[str, Path]:
    """The tools: found in `bin_dir` ($STRATA_LLAMACPP_BIN) or on PATH, else built from `src` (an sdist, a
    `pack_source` archive or a tree) under `root`; raises LlamaCppBuildError naming what to pass when neither."""
    found = find_tools(bin_dir=bin_dir)
    if found:
        return found
    if bin_dir:
        raise LlamaCppBuildError(f"{bin_dir} lacks {' or '.join(TOOLS)}; build them there or pass --llamacpp-src")
    if not src:
        raise LlamaCppBuildError("no llama.cpp tools: pass --llamacpp-src (the llama-cpp-python sdist, or the "
                                 "stripped .gpu/llama.cpp-src.tar.gz) or --llamacpp-bin DIR")
    root_dir = Path(root).expanduser() if root else default_root()
    return build_tools(prepared_source(src, root_dir), root_dir / "build", jobs=jobs, log=log, nice=nice)


def prepared_source(src: str | os.PathLike, root: Path) -> Path:
    """`prepare_source` of `src` into root/src/<key>, the key from its path, size and time (one copy per origin)."""
    origin = Path(src).expanduser().resolve()
    if not origin.exists():
        raise LlamaCppBuildError(f"--llamacpp-src {src} does not exist; give the llama-cpp-python sdist or a tree")
    stat = origin.stat()
    key = hashlib.sha256(f"{origin}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return prepare_source(origin, root / "src" / key)


def start_tools(bin_dir: str | None, src: str | None, root: str | None = None, log=print) -> Future:
    """`ensure_tools` on a thread of its own, the compilers at the lowest priority, so that a build runs while the
    suite's other cases do; the future's result is the tools (or the LlamaCppBuildError)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="llamacpp-build")
    future = pool.submit(ensure_tools, bin_dir, src, root, None, log, 19)
    pool.shutdown(wait=False)
    return future


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.suite.llamacpp_build --src SDIST [--pack OUT.tar.gz] [--no-build]`."""
    ap = argparse.ArgumentParser(prog="python -m bench.suite.llamacpp_build", description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="the llama-cpp-python sdist, a packed source or a llama.cpp tree")
    ap.add_argument("--root", default=None, help=f"prepared sources and builds (default {default_root()})")
    ap.add_argument("--pack", default=None, help="also write the stripped source as this .tar.gz (what travels)")
    ap.add_argument("--no-build", action="store_true", help="only prepare (and pack) the source")
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    root = Path(args.root).expanduser() if args.root else default_root()
    try:
        prepared = prepared_source(args.src, root)
        if args.pack:
            print(f"packed {prepared} into {pack_source(prepared, args.pack)}")
        if args.no_build:
            return 0
        tools = build_tools(prepared, root / "build", jobs=args.jobs)
    except LlamaCppBuildError as e:
        print(f"llama.cpp build: {e}", file=sys.stderr)
        return 1
    for name, path in tools.items():
        print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Run strata's GPU tests and benchmarks on a machine with an NVIDIA GPU (the figures of docs/benchmarks.md come from
# one H200, CUDA 13, 16 cores). Run it from the repository root; every step writes under $OUT.
#
#   OUT=DIR bash bench/gpu_run.sh STEP [STEP ...]
#
# Steps (each one is timed and bounded; one step fits a 10-minute command):
#   tests        every GPU test: python3 -m pytest -q -m gpu tests        -> $OUT/gpu_tests.txt
#   suite        the quick benchmark suite (12-layer bench model, uniform and skewed routing, strata against its
#                baselines, then `strata serve` start-up): python3 -m bench run --suite quick
#                                                                          -> $OUT/suite/suite.json, suite.md, suite.png
#   serve-empty  `strata serve` start-up and first requests on empty Triton and CuPy kernel caches (a fresh install:
#                the suite's serve case with STRATA_BENCH_FRESH_JIT=1)   -> $OUT/serve-empty.json
#   serve-filled the same on the machine's own kernel caches, filled by a first untimed server (a restart)
#                                                                          -> $OUT/serve-filled.json
#   tiers        the tiers' copy and read rates against the raw limits (bench/tiers.py)      -> $OUT/tiers.json
#   cpu          the CPU expert kernel against torch (bench/cpu/cpu_experts.py), then its phases a call at the default
#                knobs, cold and with its rows read ahead (bench/cpu/cpu_kernel_trace.py)
#                                                            -> $OUT/cpu_experts.json, $OUT/cpu_kernel_trace.json
#   engram       Engram tables per tier, decoding this repository's README and report (bench/engram.py)
#                                                                          -> $OUT/engram.json
#   multigpu     two cards against one, and their tests (bench/multigpu.py; needs 2 GPUs)  -> $OUT/multigpu.json
#   quant        the bench model's experts as bf16, FP8, MXFP4 and a Q4_K_M GGUF, each at bf16's 25% GPU budget in bytes
#                (`bench run --experts F --set` that budget), the GPU's quantized kernels as shipped: all in VRAM, 1 and
#                8 streams, the skewed model, an 8K prompt; FORMATS narrows it (one or two a call), CASES the cases;
#                LAYERS the model's layers (12); BUDGET that budget in bytes (else 25% of the bf16 model's expert
#                bytes, which writes that model); PER the seconds a format may take (580 / formats); DROP_SOURCE=1
#                exports a GGUF format first and removes its bf16 source from /dev/shm (48 layers: the ~61 GB it
#                holds leave the GGUF's pinned tier short of RAM, and the suite skips its tiered cases)
#                                                                     -> $OUT/quant/FORMAT/suite.json, suite.md
#   newarch      a new architecture's bench-size model (ARCH: deepseek_v4 with 2 layers, or qwen3_5_moe with 4; LAYERS
#                another count): all in VRAM at 1 and 8 streams, and 25% of the experts' bytes in VRAM, against their
#                rooflines (`bench run --model`)                                  -> $OUT/newarch/ARCH/suite.json
#   newarch-pause  on that model (written by newarch, or now), a 64K-token prompt at the 25% budget while 4 users
#                decode: bench/serving.py's pause                                 -> $OUT/newarch/ARCH/serving.json
#   tiered       one stream at 25% of the experts' bytes in VRAM (split/b25/uniform/p128x1) on the 12-layer Qwen3 bench
#                model and the new architectures' bench models (qwen3_5_moe at the same 12 layers, so that its LM head
#                and the step's other fixed work weigh as much as Qwen3's; deepseek_v4 at 2, all a host's RAM holds), in
#                one call, so their tiered roofline fractions (the CPU rate measured on that host) compare; ARCHS
#                narrows it                                                     -> $OUT/tiered/ARCH/suite.json
#   phases       a short prompt's prefill at a 25% GPU budget on the 12-layer bench model, host time by phase of
#                each MoE layer (bench/probes/prefill_phases.py; PROMPTS: its prompt lengths)  -> $OUT/phases/
#   llamacpp-build  llama.cpp's llama-bench and llama-batched-bench for CUDA sm_90, from the stripped source that
#                `wheels` packed (.gpu/llama.cpp-src.tar.gz), into ~/.cache/strata/bench/llamacpp (ninja resumes a
#                build a time limit cut short: run the step again)              -> $OUT/llamacpp-build.txt
#   llamacpp     strata against llama.cpp on the same weights (the llamacpp suite: bf16 and Q4_K_M GGUF exports of the
#                12-layer bench model, strata on the bf16 checkpoint and on the Q4_K_M file, 25% budget, decode of 1/4/8
#                streams, prefill of 512 and 8K tokens; one stream all in VRAM; llama.cpp's
#                cases run last and wait for its build; CASES narrows it: one routing a call, CASES='*/uniform/*',
#                then CASES='*/skewed/*' into another OUT, merged by `python -m bench report A.json B.json`)
#                                                      -> $OUT/llamacpp/suite.json, suite.md, suite-llamacpp.png
#   all          tests suite serve-empty serve-filled (for a machine without a per-command time limit)
#   wheels       on a machine with internet access, not the GPU machine: fetch into .whl/ (git-ignored) the wheels the
#                GPU machine lacks (the server's stack, kvikio for CUDA 13); carry .whl/ to the GPU machine, where
#                every other step installs them into /tmp/site first; and .gpu/llama.cpp-src.tar.gz (git-ignored,
#                ~8 MB): llama.cpp's source as llama-cpp-python's sdist vendors it (LLAMACPP_SDIST, else downloaded),
#                stripped of docs, models, tests and the backends other than CPU and CUDA
#
# Options, from the environment:
#   OUT        where every step writes (default: ./gpu-out); $OUT/summary.txt gets one line a step (its exit status
#              and seconds). The files above are all a step keeps, so that a tool returning few files gets them all.
#   COMMIT     the commit to record in the suite's results (STRATA_BENCH_COMMIT), for a copy of the tree without
#              its git metadata, e.g. COMMIT=$(git rev-parse --short HEAD) where the tree was copied from
#   DEADLINE   seconds after which the suite skips its remaining cases (default 540)
#   CASES      the suite's (or the llamacpp step's) case patterns instead of every case, e.g. CASES="split/b25/*"
#   TESTS      test files for `tests` instead of all of tests/
#   BASELINES  baselines the suite step adds to every strata split case it runs, e.g. BASELINES=llamacpp
#              (bench run --baselines; llama.cpp's tools are found or built as the llamacpp step does)
set -uo pipefail

[ -f bench/gpu_run.sh ] || { echo "bench/gpu_run.sh: run it from the repository root" >&2; exit 2; }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SCRATCH=/dev/shm/strata-gpu-run  # the steps' own models and stores (the suite's live under /dev/shm/strata-suite)
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || { sed -n '2,/^set /p' "$0" | sed '$d'; exit 2; }
[ "${STEPS[*]}" = all ] && STEPS=(tests suite serve-empty serve-filled)
[ -n "${COMMIT:-}" ] && export STRATA_BENCH_COMMIT=$COMMIT
export PYTHONPATH=/tmp/site:$PWD

wheels() {  # the GPU machine has no internet; pydantic and pydantic-core are pinned as the pair the tests passed with;
  # transformers as the tests' oracle (the image's 5.17 computes gpt-oss's clamp and MiniMax-M2's partial rotary
  # differently from the 5.25 strata follows), with the hub client and packages it needs
  mkdir -p .whl && rm -f .whl/*.whl  # two versions of one package stop the whole install: start from none
  local p
  for p in fastapi starlette uvicorn h11 annotated-doc opentelemetry-api pydantic==2.13.4 pydantic-core==2.46.4 \
           annotated-types typing-inspection anyio prometheus-client aiofiles msgpack xxhash kvikio-cu13 \
           libkvikio-cu13 rapids-logger xgrammar==0.2.9 apache-tvm-ffi gguf transformers==5.25.0 huggingface-hub==2.4.0 \
           kernels==0.19.1 httpx2 httpcore2 truststore tomlkit click regex; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "$p" || return 1
  done
  echo "wheels in .whl/: $(ls .whl | wc -l)"
  llamacpp_source
}

llamacpp_source() {  # llama.cpp's stripped source, to build on the GPU machine (bench/suite/llamacpp_build.py)
  local sdist=${LLAMACPP_SDIST:-}
  if [ -z "$sdist" ]; then
    mkdir -p .gpu/sdist
    python3 -m pip download -q --no-deps --no-binary :all: -d .gpu/sdist llama-cpp-python==0.3.36 || return 1
    sdist=.gpu/sdist/llama_cpp_python-0.3.36.tar.gz
  fi
  python3 -m bench.suite.llamacpp_build --src "$sdist" --pack .gpu/llama.cpp-src.tar.gz --no-build
}

install_wheels() {  # the carried wheels, into /tmp/site (on $PYTHONPATH)
  compgen -G ".whl/*.whl" > /dev/null || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}

# one case of the suite (serve start-up) into $OUT/$1.json; the rest of the arguments go to `bench run`
serve_case() {
  local name=$1 dir="$SCRATCH/$1"; shift
  rm -rf "$dir"
  timeout 280 python3 -m bench run --suite quick --deadline 240 --cases 'serve/b25/uniform/startup' --out "$dir" "$@" \
    2>&1 | grep -E '^serve/|Error'
  local rc=${PIPESTATUS[0]}
  cp "$dir/suite.json" "$OUT/$name.json" 2>/dev/null
  return "$rc"
}

free_scratch() {  # RAM that other steps' models hold in /dev/shm is RAM a suite's pinned tier lacks (it skips such
  # cases): on a warm machine, the newarch and tiered steps leave ~35 GB of models there
  rm -rf "$SCRATCH"
}

step() {
  case "$1" in
    tests)
      # shellcheck disable=SC2086  # TESTS is a list of files
      timeout 560 python3 -m pytest -q -m gpu ${TESTS:-tests} > "$OUT/gpu_tests.txt" 2>&1
      local rc=$?; tail -3 "$OUT/gpu_tests.txt"; return "$rc" ;;
    suite)
      free_scratch; rm -rf "$OUT/suite"
      local args=(--suite quick --deadline "${DEADLINE:-540}" --out "$OUT/suite") cases=()
      if [ -n "${CASES:-}" ]; then read -r -a cases <<< "$CASES"; args+=(--cases "${cases[@]}"); fi
      # shellcheck disable=SC2206  # BASELINES is a list of names
      [ -n "${BASELINES:-}" ] && args+=(--baselines ${BASELINES})
      timeout 590 python3 -m bench run "${args[@]}" 2>&1 | tail -20
      local rc=${PIPESTATUS[0]}
      rm -f "$OUT/suite/serve.toml" "$OUT/suite/serve.log"; return "$rc" ;;
    serve-empty)
      STRATA_BENCH_FRESH_JIT=1 serve_case serve-empty ;;
    serve-filled)
      serve_case serve-filled-first > /dev/null; rm -f "$OUT/serve-filled-first.json"  # fills the caches
      serve_case serve-filled ;;
    tiers)
      timeout 590 python3 bench/tiers.py --out "$OUT" 2>&1 | tail -25; return "${PIPESTATUS[0]}" ;;
    cpu)
      timeout 300 python3 bench/cpu/cpu_experts.py --out "$OUT" 2>&1 | tail -12 || return 1
      timeout 280 python3 bench/cpu/cpu_kernel_trace.py --threads 12 --calls 200 --knobs "claim_ahead=4,down_split=1" \
        --own 5 --out "$OUT" 2>&1 | tail -20; return "${PIPESTATUS[0]}" ;;
    engram)
      timeout 590 python3 bench/engram.py --out "$SCRATCH/engram-out" --model-dir "$SCRATCH/engram" --steps 200 \
        --text README.md,docs/benchmarks.md --prime 8000 --cases gpu,pinned,tmpfs,disk,disk-noprefetch 2>&1 | tail -8
      local rc=${PIPESTATUS[0]}
      cp "$SCRATCH/engram-out/engram.json" "$OUT/" 2>/dev/null; return "$rc" ;;
    multigpu)
      timeout 200 python3 -m pytest -q -m gpu tests/plan/test_multi_gpu.py 2>&1 | tail -3
      [ -d "$SCRATCH/b12" ] || python3 -m strata demo-model "$SCRATCH/b12" --size bench --layers 12 --no-engram \
        --route-skew uniform > /dev/null || return 1
      timeout 300 python3 bench/multigpu.py --model "$SCRATCH/b12" --gpus 0,1 --budget 3.6GiB --tokens 32 \
        --out "$OUT" 2>&1 | tail -8; return "${PIPESTATUS[0]}" ;;
    quant)
      free_scratch
      local f budget cases layers=${LAYERS:-12} per=${PER:-$((580 / $(wc -w <<< "${FORMATS:-bf16 fp8 mxfp4 q4_k_m}")))}
      read -r -a cases <<< "${CASES:-ceiling/all/uniform/p128x1 split/b25/uniform/p128x1 split/b25/uniform/p128x8 split/b25/skewed/p128x1 split/b25/uniform/p8192x1}"
      budget=${BUDGET:-$(python3 -c "from pathlib import Path; from bench.suite.models import ensure_model, model_facts
m = ensure_model(Path('/dev/shm/strata-suite/models'), 'bench', $layers, 'uniform', 1.0, progress=False)
print(int(0.25 * model_facts(m)[1]['expert_bytes_total']))")} || return 1
      for f in ${FORMATS:-bf16 fp8 mxfp4 q4_k_m}; do
        rm -rf "$OUT/quant/$f"
        if [ -n "${DROP_SOURCE:-}" ] && [ "${f:0:1}" = q ]; then  # the GGUF now, then its bf16 source out of RAM
          python3 -c "import sys; from pathlib import Path; from bench.suite.models import demo_model_path, ensure_model
d, size, layers, f = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
ensure_model(d, size, layers, 'uniform', 1.0, progress=False, experts=f)
src = demo_model_path(d, size, layers, 'uniform', 1.0, 0.0)  # its weights and marker (config, tokenizer stay)
[p.unlink() for p in [*src.glob('*.safetensors'), src / 'strata_demo.json'] if p.exists()]" \
            /dev/shm/strata-suite/models bench "$layers" "$f" || return 1
        fi
        timeout "$per" python3 -m bench run --suite full --layers "$layers" \
          --tokens 64 --experts "$f" --deadline $((per - 20)) --out "$OUT/quant/$f" \
          --set "{\"tiers\": {\"gpu\": {\"budget\": \"$budget\"}}}" --cases "${cases[@]}" 2>&1 | grep -E 'tok/s|rror'
        rm -f "$OUT/quant/$f/suite.png"
      done ;;
    newarch|newarch-pause)
      local arch=${ARCH:-deepseek_v4} model rc budget
      model="$SCRATCH/newarch-$arch"
      [ -d "$model" ] || timeout 300 python3 -m strata demo-model "$model" --arch "$arch" --size bench --no-engram \
        --layers "${LAYERS:-$([ "$arch" = deepseek_v4 ] && echo 2 || echo 4)}" > /dev/null || return 1
      mkdir -p "$OUT/newarch/$arch"
      if [ "$1" = newarch ]; then
        timeout 400 python3 -m bench run --suite full --model "$model" --tokens 64 --deadline 380 \
          --out "$OUT/newarch/$arch" --cases 'ceiling/all/uniform/p128x1' 'ceiling/all/uniform/p128x8' \
          'split/b25/uniform/p128x1' 2>&1 | grep -E 'tok/s|rror|skipped'
        rc=${PIPESTATUS[0]}
        rm -f "$OUT/newarch/$arch/suite.png"
        return "$rc"
      fi
      budget=$(python3 -c "from pathlib import Path; from bench.suite.models import model_facts
print(int(0.25 * model_facts(Path('$model'))[1]['expert_bytes_total']))") || return 1
      printf '[tiers.gpu]\nbudget = "%s"\n' "$budget" > "$SCRATCH/newarch.toml"
      timeout 400 python3 bench/serving.py --model "$model" --config "$SCRATCH/newarch.toml" --users '' \
        --repro-users '' --long-prompt 65536 --max-context 65600 --out "$OUT/newarch/$arch" 2>&1 | tail -6
      return "${PIPESTATUS[0]}" ;;
    tiered)
      local a model per rc=0
      per=$((570 / $(wc -w <<< "${ARCHS:-qwen3 deepseek_v4 qwen3_5_moe}")))
      for a in ${ARCHS:-qwen3 deepseek_v4 qwen3_5_moe}; do
        local args=(--suite full --tokens 64 --deadline $((per - 30)) --out "$OUT/tiered/$a" --cases 'split/b25/uniform/p128x1')
        if [ "$a" = qwen3 ]; then
          args+=(--layers 12)
        else
          local layers; layers=$([ "$a" = deepseek_v4 ] && echo 2 || echo 12)
          model="$SCRATCH/tiered-$a-$layers"
          [ -d "$model" ] || timeout 200 python3 -m strata demo-model "$model" --arch "$a" --size bench --no-engram \
            --layers "$layers" > /dev/null || { rc=1; continue; }
          args+=(--model "$model")
        fi
        timeout "$per" python3 -m bench run "${args[@]}" 2>&1 | grep -E 'tok/s|rror|skipped'
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        rm -f "$OUT/tiered/$a/suite.png"
        # the next model's pinned tier needs the RAM this one's files hold in /dev/shm (DeepSeek-V4's 26.5 GB left
        # Qwen3.5-MoE's case "host RAM short")
        [ "$a" = qwen3 ] || rm -rf "$model"
      done
      return "$rc" ;;
    phases)
      local m
      m=$(python3 -c "from pathlib import Path; from bench.suite.models import ensure_model
print(ensure_model(Path('/dev/shm/strata-suite/models'), 'bench', 12, 'uniform', 1.0, progress=False))") || return 1
      timeout 400 python3 bench/probes/prefill_phases.py --model "$m" --prompt ${PROMPTS:-128 192 512} \
        --out "$OUT/phases" ;;
    llamacpp-build)
      timeout 590 python3 -m bench.suite.llamacpp_build --src .gpu/llama.cpp-src.tar.gz > "$OUT/llamacpp-build.txt" 2>&1
      local rc=$?; tail -3 "$OUT/llamacpp-build.txt"; return "$rc" ;;
    llamacpp)
      free_scratch; rm -rf "$OUT/llamacpp"
      local args=(--suite llamacpp --deadline "${DEADLINE:-540}" --out "$OUT/llamacpp") cases=()
      if [ -n "${CASES:-}" ]; then read -r -a cases <<< "$CASES"; args+=(--cases "${cases[@]}"); fi
      timeout 590 python3 -m bench run "${args[@]}" 2>&1 | tail -30
      return "${PIPESTATUS[0]}" ;;
    wheels)
      wheels ;;
    *)
      echo "bench/gpu_run.sh: unknown step '$1' (the steps: bash bench/gpu_run.sh with none)" >&2; return 2 ;;
  esac
}

if [ "${STEPS[*]}" != wheels ]; then
  install_wheels || { echo "bench/gpu_run.sh: installing the wheels in .whl/ failed" >&2; exit 1; }
fi
status=0
for s in "${STEPS[@]}"; do
  echo "== $s"
  start=$SECONDS
  step "$s"; rc=$?
  echo "$s: exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"

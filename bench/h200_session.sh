#!/usr/bin/env bash
# The GPU-box runs behind bench/RESULTS.md's figures, one mode per call (or several chained in one call).
#   bash bench/h200_session.sh tests|tests-decode|diag|inengine|hotpath|ramshared|multigpu|serving|serving-bench|
#                              ceiling48|engram|engram-profile|engram-text|handshake|prefill-skew|chunk|next|trace|
#                              suite|probe|mailbox|timeline|timeline-one|profile|profile-ceiling|core|cap-summary|
#                              thirtyseventh|thirtyseventh-b|thirtyseventh-c|thirtyseventh-d|thirtyeighth|thirtyeighth-b
#                              (writes under $OUT)
# The earlier sessions' modes (eleventh ... thirtysixth-c, quoted in bench/RESULTS.md) live in
# bench/h200_past_sessions.sh and still run by name: a mode not found here is looked up there (past_session_mode).
# A finished session's modes move there verbatim, with the helpers only they use.
# fastapi/uvicorn/pydantic wheels are carried in .whl/ (the box has no internet; pydantic is not on it either):
# `bash bench/box_wheels.sh` fetches them here.
# SKIP_TESTS=1: the modes that start with every GPU test skip them.
# The box's copy of the tree carries stale git metadata: put the local commit into the command, e.g.
# `STRATA_BENCH_COMMIT=<git rev-parse HEAD here> bash bench/h200_session.sh suite`, for the suite to record it.
set -u
export PYTHONPATH=/tmp/site:$PWD STRATA_CACHE=/dev/shm/sc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
# every GPU test, into $OUT/gpu_tests.txt, its last $1 lines shown (default 3); none with SKIP_TESTS=1
gpu_tests() {
  [ -n "${SKIP_TESTS:-}" ] || { timeout 270 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1
                                tail -"${1:-3}" "$OUT/gpu_tests.txt"; }
}
# one bench/profile_prefill.py run of an 8K prompt: $1 checkpoint dir, $2 label, $3 chunk (-1: the config's, 0: the
# whole prompt), $4 GPU budget in GiB, $5 runtime.prefill_keeps_resident ("": the default)
prefill_run() {
  local keep=""; [ -n "${5:-}" ] && keep=', "runtime": {"prefill_keeps_resident": '$5'}'
  timeout 100 python3 bench/profile_prefill.py --model "$1" --label "$2" --chunk "$3" --out "$OUT" \
    --config '{"tiers": {"gpu": {"budget": "'$4'GiB"}}'"$keep"'}' 2>&1 | grep -E 'prefilled|Error' | cut -c1-300
}
# One run of case $2 of the suite (12 layers, 64 tokens) into $OUT/ab/$1, its result line prefixed with $1; the rest of
# the arguments go to `bench run`, knobs in the environment apply (ab_summary reads $OUT/ab afterwards)
ab_case() {
  local label=$1 case=$2; shift 2
  timeout 100 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 90 --cases "$case" \
    --out "$OUT/ab/$label" "$@" 2>&1 | grep -E '^split/' | sed "s/^/$label: /"
}
# One line a run and one file (share_ab.json) of the suite runs under $OUT/ab/<label>/ (then removed): tok/s, the
# roofline fraction, hit rate, the GPU share and its mode, the worker's window and the step split from it
ab_summary() {
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); runs = {}
for p, c in [(p, c) for p in sorted(out.glob("ab/*/suite.json")) for c in json.load(open(p))["cases"]]:
    label, m = f"{p.parent.name}:{c['name']}", c.get("metrics") or {}
    runs[label] = c
    if not m.get("decode_tok_s"):
        print(label, c.get("status"), c.get("reason")); continue
    og = (m.get("decode_state") or {}).get("one_graph_decode") or {}
    w, step = m.get("mailbox_window") or {}, 1000 / m["decode_tok_s"]
    cold, between = 12 * w.get("serve_us", 0) / 1000, 11 * (w.get("gpu_gap_us") or 0) / 1000
    print(p.parent.name, m["decode_tok_s"], c.get("fraction_of_roofline"), "hit", m["gpu_hit_rate"],
          "share", round(og.get("gpu_share") or 0, 3), og.get("gpu_share_mode"), "promo/tok", m["promotions_per_token"],
          "step ms", round(step, 3), "cold", round(cold, 3), "between", round(between, 3), "ends", round(step - cold - between, 3),
          "promotions", (m.get("decode_state") or {}).get("promotions"), "books_s", og.get("books_s"), "deferred", og.get("books_deferred"), "window", w)
json.dump(runs, open(out / "share_ab.json", "w"), indent=1)
PY
  rm -rf "$OUT/ab"
}
case "$1" in
  tests)
    gpu_tests 5
    timeout 60 python3 -m pytest -q tests/test_engram_verify.py 2>&1 | tail -2 ;;  # its pinned path pins on CUDA
  hotpath)  # $2 = route skew ("uniform" or a Zipf exponent), $3 = cases (default below)
    python3 -m strata demo-model "/dev/shm/b12-$2" --size bench --layers 12 --no-engram --route-skew "$2" > /dev/null 2>&1
    timeout 300 python3 bench/hotpath.py --model "/dev/shm/b12-$2" --cache /dev/shm/sc --out "$OUT/hotpath-$2" --tokens 64 \
      --prefill "${PREFILL:-8192}" --cases "${3:-ceiling,split,split_nostream,split_async,copy,cpu}" 2>&1 | grep '^{"' | cut -c1-400 ;;
  ramshared)  # do PCIe copies and the CPU kernel share host RAM bandwidth? $2 = cards copying (default 0)
    for t in 16 8; do timeout 120 python3 bench/ram_shared.py --gpus "${2:-0}" --threads $t --out "$OUT/ram_shared_t$t"; done ;;
  multigpu)  # on nvidia-h200-x2: the two-card tests (graphs per card among them), then the bench
    timeout 150 python3 -m pytest -q -m gpu tests/test_multi_gpu.py 2>&1 | tail -4
    [ -d /dev/shm/b12 ] || python3 -m strata demo-model /dev/shm/b12 --size bench --layers 12 --no-engram \
      --route-skew uniform > /dev/null 2>&1
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; cat "$OUT/topo.txt"
    timeout 150 python3 bench/multigpu.py --model /dev/shm/b12 --gpus 0,1 --budget 3.6GiB --tokens 32 --out "$OUT/multigpu" 2>&1 | tail -8 ;;
  serving)  # the small demo model (8K context)
    timeout 200 python3 bench/serving.py --out "$OUT/serving" --max-tokens 64 2>&1 | grep -v '^INFO' | tail -12 ;;
  serving-bench)  # the bench model cut to 12 layers, no Engram (CUDA graphs), a 40K-token prompt for the pause
    [ -d /dev/shm/b12 ] || python3 -m strata demo-model /dev/shm/b12 --size bench --layers 12 --no-engram > /dev/null 2>&1
    timeout 280 python3 bench/serving.py --model /dev/shm/b12 --out "$OUT/serving-bench" --max-tokens 64 \
      --max-context 40960 --repro-users '' 2>&1 | grep -v '^INFO' | tail -12 ;;
  ceiling48)
    rm -rf /dev/shm/b12 /dev/shm/sc
    python3 -m strata demo-model /dev/shm/b48 --size bench --no-engram > /dev/null 2>&1
    timeout 300 python3 bench/hotpath.py --model /dev/shm/b48 --out "$OUT/hotpath-48" --tokens 64 --prefill 2048 \
      --cases "${2:-ceiling,ceiling_eager}" 2>&1 | grep '^{"' | cut -c1-400 ;;
  suite)  # the benchmark suite's quick run (issue 7): one 10-minute call. The other modes' models and stores go
    # first: RAM they hold in /dev/shm is RAM the suite's pinned tier lacks (its cases would be skipped)
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    timeout 590 python3 -m bench run --suite quick --deadline "${DEADLINE:-560}" --out "$OUT/suite" 2>&1 | tail -15 ;;
  profile)  # where a tiered decode step's time goes (issue 4): 12 layers, uniform routing, 25% GPU budget
    [ -d /dev/shm/b12 ] || python3 -m strata demo-model /dev/shm/b12 --size bench --layers 12 --no-engram \
      --route-skew uniform > /dev/null 2>&1
    timeout 200 python3 bench/profile_decode.py --model /dev/shm/b12 --host --no-kernels --tokens 16 --out "$OUT/profile" \
      --config '{"tiers": {"gpu": {"budget": "3.6GiB"}}, "runtime": {"max_context": 1024}}' 2>&1 | grep -E "probe|tok/s"
    [ "${2:-}" = copy ] && timeout 200 python3 bench/profile_decode.py --model /dev/shm/b12 --host --no-kernels --tokens 16 \
      --out "$OUT/profile-copy" --config '{"tiers": {"gpu": {"budget": "3.6GiB"}}, "runtime": {"max_context": 1024, "cpu_numerics": "gpu"}}' \
      2>&1 | grep -E "tok/s" ;;
  profile-ceiling)  # the all-in-VRAM decode step's kernels (issue 7's 250 tok/s): 12 layers
    [ -d /dev/shm/b12 ] || python3 -m strata demo-model /dev/shm/b12 --size bench --layers 12 --no-engram \
      --route-skew uniform > /dev/null 2>&1
    timeout 200 python3 bench/profile_decode.py --model /dev/shm/b12 --no-kernels --tokens 32 --out "$OUT/profile-ceiling" \
      2>&1 | grep -E "tok/s" ;;
  tests-decode)  # the GPU tests of the decode kernels and paths only (after a change there)
    timeout 240 python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_gpu.py tests/test_decode_path.py tests/test_decode_graphs.py \
      tests/test_step_copies.py > "$OUT/gpu_tests_decode.txt" 2>&1; tail -3 "$OUT/gpu_tests_decode.txt" ;;
  handshake)  # the twelfth session: the Engram rows' handshake (one graph a step with disk tables): its GPU tests, the
              # host side alone on this box's CPU and disk (engram_step_host --handshake, row_reads), then the Engram
              # bench with the disk case through it and through the segmented graphs it replaces
    timeout 200 python3 -m pytest -q -m gpu tests/test_engram_handshake.py tests/test_engram.py tests/test_decode_path.py tests/test_decode_graphs.py \
      tests/test_tier_primitives.py > "$OUT/gpu_tests_engram.txt" 2>&1
    tail -3 "$OUT/gpu_tests_engram.txt"
    timeout 60 python3 -m pytest -q tests/test_engram_handshake.py tests/test_engram_verify.py 2>&1 | tail -2
    timeout 150 python3 bench/engram_step_host.py --handshake --steps 300 --out "$OUT/step-host" 2>&1 | tail -1 | cut -c1-600
    t=$(ls ~/.cache/strata-engram-step/stores/*/tables/engram.1.bin | head -1)
    timeout 100 python3 bench/row_reads.py --table "$t" --reps 200 --out "$OUT/row-reads" 2>&1 | tail -1
    timeout 330 python3 bench/engram.py --out "$OUT/engram" --model-dir /dev/shm/engram --steps 200 \
      --cases "${2:-gpu,pinned,tmpfs,disk,disk-noprefetch,disk-segmented}" 2>&1 | tail -9 | cut -c1-700 ;;
  engram-text)  # the thirteenth session's first call: the Engram bench on real text (the repo's README and RESULTS,
                # the model's tokenizer) with the row caches primed by 8,000 tokens a stream, beside the Zipf run
    timeout 300 python3 bench/engram.py --out "$OUT/engram-text" --model-dir /dev/shm/engram --steps 200 \
      --text README.md,bench/RESULTS.md --prime 8000 --cases "${2:-gpu,pinned,tmpfs,disk,disk-noprefetch}" 2>&1 \
      | tail -7 | cut -c1-400 ;;
  prefill-skew)  # for the fourteenth session: why the tiered 8K prefill runs 2.5x slower under skewed routing than
                 # uniform (RESULTS, thirteenth session): 4-layer checkpoints, 25% budget, split against copy-only,
                 # torch.profiler's kernel tables in $OUT/profile_prefill-*.txt
    for r in uniform 1.0; do
      python3 -m strata demo-model /dev/shm/b4-$r --size bench --layers 4 --no-engram --route-skew $r > /dev/null 2>&1
      for c in split copy; do
        cfg='{"tiers": {"gpu": {"budget": "1.12GiB"}}}'
        [ $c = copy ] && cfg='{"tiers": {"gpu": {"budget": "1.12GiB"}}, "runtime": {"cpu_numerics": "gpu"}}'
        timeout 60 python3 bench/profile_prefill.py --model /dev/shm/b4-$r --label $c-$r --config "$cfg" --out "$OUT" \
          2>&1 | grep prefilled
      done
    done ;;
  chunk)  # what the old default runtime.prefill_chunk (512) cost an 8K prompt at a 25% budget (4-layer checkpoints)
    for r in uniform 1.0; do
      python3 -m strata demo-model /dev/shm/b4-$r --size bench --layers 4 --no-engram --route-skew $r > /dev/null 2>&1
      for c in 8192 2048 512; do prefill_run /dev/shm/b4-$r "chunk$c-$r" $c 1.12 false; done
    done ;;
  next)  # the twelfth session's first call: GPU tests of the eleventh session's changes (books after the launch, in
         # bulk; parking), then where a one-graph token's ~0.5 ms beyond the ceiling's goes: the kernel's workers parked
         # after each step, spinning 100 us, no books at all (then run `suite`)
    timeout 150 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_decode_path.py tests/test_decode_graphs.py tests/test_gpu_tiers.py \
      tests/test_gpu.py > "$OUT/gpu_tests_next.txt" 2>&1; tail -3 "$OUT/gpu_tests_next.txt"
    timeout 200 bash "$0" timeline-one 1.0 "split,split+spin100,split+nobooks"  # (+park: removed after this call)
    timeout 100 bash "$0" timeline-one uniform "split" ;;
  timeline-one)  # bench/step_timeline.py on one routing ($2) with cases $3
    python3 -m strata demo-model "/dev/shm/b12-$2" --size bench --layers 12 --no-engram --route-skew "$2" > /dev/null 2>&1
    python3 bench/step_timeline.py --model "/dev/shm/b12-$2" --tokens 40 --out "$OUT/timeline-$2" --cases "$3" 2>&1 \
      | grep '^{"' | cut -c1-1500 ;;
  diag)  # the tenth session's second call (at f5c6827 it also ran the since removed +block/+thp toggles): the mailbox's
         # per-layer timing, grouped prefill's GPU tests
    timeout 150 python3 -m pytest -q -m gpu tests/test_grouped_prefill.py tests/test_gpu_tiers.py tests/test_gpu.py \
      tests/test_cpu_mailbox.py tests/test_decode_path.py tests/test_decode_graphs.py > "$OUT/gpu_tests_diag.txt" 2>&1; tail -3 "$OUT/gpu_tests_diag.txt"
    export PREFILL=0
    timeout 200 bash "$0" hotpath uniform "ceiling,split,split+share0"
    timeout 150 bash "$0" hotpath 1.0 "split" ;;
  inengine)  # the CPU kernel's rate on an engine's own experts outside decode, then in decode with spare cores / no promotions
    python3 -m strata demo-model /dev/shm/b12-uniform --size bench --layers 12 --no-engram --route-skew uniform > /dev/null 2>&1
    timeout 150 python3 bench/mailbox_probe.py --model /dev/shm/b12-uniform --replays 20 --out "$OUT/mailbox-engine" 2>&1 | tail -8
    PREFILL=0 timeout 150 bash "$0" hotpath uniform "split+share0+t12,split_nopromote+share0" ;;
  core)  # one 10-minute call: the GPU tests, the Engram tiers, the uniform hot path
    bash "$0" tests; bash "$0" engram; bash "$0" hotpath uniform ;;
  engram-profile)  # the Engram cases that matter for the disk target, the disk case's host time under cProfile
    timeout 280 python3 bench/engram.py --out "$OUT/engram" --model-dir /dev/shm/engram --steps 200 \
      --cases gpu,pinned,disk,disk-noprefetch,disk-pyio --profile disk 2>&1 | tail -8 ;;
  trace)  # the suite's skewed 12-layer checkpoint's routing, for bench/promote_sim.py --trace on any machine
    python3 -m strata demo-model /dev/shm/b12s --size bench --layers 12 --no-engram --route-skew 1.0 > /dev/null 2>&1
    timeout 200 python3 bench/route_trace.py --model /dev/shm/b12s --out "$OUT/trace-b12-skew1.json" --tokens 256 2>&1 | tail -2 ;;
  probe)  # a split layer's host calls timed one by one (idle and under CPU-kernel load), then an 8K prefill profiled
    [ -d /dev/shm/b12 ] || python3 -m strata demo-model /dev/shm/b12 --size bench --layers 12 --no-engram \
      --route-skew uniform > /dev/null 2>&1
    timeout 120 python3 bench/stage_probe.py --model /dev/shm/b12 --out "$OUT/probe" 2>&1 | tail -3 | cut -c1-3000
    for c in ceiling split; do
      cfg='{"runtime": {"experts": "memory"}}'; [ $c = split ] && cfg='{"tiers": {"gpu": {"budget": "3.6GiB"}}}'
      timeout 150 python3 bench/profile_prefill.py --model /dev/shm/b12 --label $c --config "$cfg" --out "$OUT/probe" 2>&1 \
        | grep -v Warning | head -30 | cut -c1-200
    done ;;
  mailbox)  # one-graph split decode's cost per MoE layer by cold experts (fixed cost: the 0-cold row), two thread counts
    for t in 15 12; do timeout 100 python3 bench/mailbox_probe.py --threads $t --out "$OUT/mailbox-t$t" 2>&1 | tail -5; done ;;
  timeline)  # a one-graph split step end to end (host, GPU events, the worker's clock), uniform and skewed routing
    for r in uniform 1.0; do timeout 240 bash "$0" timeline-one "$r" "${2:-split,split+share0,ceiling}"; done ;;
  thirtyseventh)  # every GPU test (the copy path's wait now the acquire kernel), then the full suite's one-stream budget
                  # sweep and the 25% multi-stream cases, whose rows in RESULTS predate the last sessions (12 layers)
    gpu_tests 5
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    timeout "${SWEEP_TIMEOUT:-400}" python3 -m bench run --suite full --layers 12 --tokens 64 --deadline "${SWEEP_DEADLINE:-360}" \
      --out "$OUT/sweep" --cases ${SWEEP_CASES:-'split/b10/*/p128x1' 'split/b40/uniform/p128x1' 'split/b50/*/p128x1' 'split/b25/*/p128x[48]'} \
      2>&1 | grep -vE "^---" | tail -14
    rm -f "$OUT"/sweep/*.png ;;
  thirtyseventh-b)  # the GPU tests of the Engram handshake and the mailbox (both wait with host_signal.wait_for_host
                    # now), then why 25% uniform decode of 4 streams runs at ~50 tok/s (the worker saw ~3.5 ms from its
                    # answer to the next post, against ~0.05-0.1 ms at 1 stream or skewed): the default against a fixed
                    # GPU share of 0.1, none (no in-place share, no warm-ahead), warm-ahead off, the resident pairs first
    timeout 200 python3 -m pytest -q -m gpu tests/test_engram_handshake.py tests/test_engram.py tests/test_decode_graphs.py \
      tests/test_cpu_mailbox.py > "$OUT/gpu_tests_b.txt" 2>&1; tail -2 "$OUT/gpu_tests_b.txt"
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    c=split/b25/uniform/p128x4
    ab_case default "$c"
    STRATA_MAILBOX_GPU_SHARE=0.1 ab_case share0.1 "$c"
    STRATA_MAILBOX_GPU_SHARE=0 ab_case share0 "$c"
    ab_case warm-off "$c" --set '{"runtime": {"warm_ahead": false}}'
    STRATA_MAILBOX_HOT_ALONGSIDE=0 ab_case hot-first "$c"
    ab_summary ;;
  thirtyseventh-c)  # 4-stream decode with warm-ahead: the kernels of the 25% uniform case with it and without
                    # (bench/kernel_trace.py), fixed GPU shares of 0.2 and 0.27 with it, then the skewed case with and
                    # without it
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    c=split/b25/uniform/p128x4
    STRATA_BENCH_TRACE="$OUT/trace-warm" ab_case warm-traced "$c"
    STRATA_BENCH_TRACE="$OUT/trace-nowarm" ab_case nowarm-traced "$c" --set '{"runtime": {"warm_ahead": false}}'
    STRATA_MAILBOX_GPU_SHARE=0.2 ab_case warm-share0.2 "$c"
    STRATA_MAILBOX_GPU_SHARE=0.27 ab_case warm-share0.27 "$c"
    ab_case warm-skewed split/b25/skewed/p128x4
    ab_case nowarm-skewed split/b25/skewed/p128x4 --set '{"runtime": {"warm_ahead": false}}'
    ab_summary ;;
  thirtyseventh-d)  # 4-stream 25% uniform decode with warm-ahead: the layers' periods and the slowest layers' kernels
                    # (bench/kernel_trace.py), with the next layer's plan made before the in-place share
                    # (STRATA_WARM_PLAN_FIRST=1) and without; then untraced, alternated, with the skewed case. Ran once
                    # at b5292b0; the knob was removed after it (no difference: bench/RESULTS.md, thirty-seventh session)
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    c=split/b25/uniform/p128x4
    STRATA_BENCH_TRACE="$OUT/trace-warm" ab_case warm-traced "$c"
    STRATA_WARM_PLAN_FIRST=1 STRATA_BENCH_TRACE="$OUT/trace-planfirst" ab_case planfirst-traced "$c"
    STRATA_WARM_PLAN_FIRST=1 ab_case planfirst "$c"
    ab_case warm "$c"
    STRATA_WARM_PLAN_FIRST=1 ab_case planfirst-skewed split/b25/skewed/p128x4
    ab_case warm-skewed split/b25/skewed/p128x4
    ab_summary ;;
  thirtyeighth)  # every GPU test (the serve warm-up's among them), then `strata serve` on the 12-layer uniform bench
                 # model at 25%: start-up and its first requests (one, then four at once, each twice) without the
                 # warm-up and with it, alternated, each server on empty Triton and CuPy caches (a fresh install)
    gpu_tests 5
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    for r in 1 2; do
      for w in false true; do
        STRATA_BENCH_FRESH_JIT=1 timeout 170 python3 -m bench run --suite full --layers 12 --deadline 160 \
          --cases 'serve/b25/uniform/startup' --set '{"runtime": {"warmup": '$w'}}' --out "$OUT/serve/$w-$r" 2>&1 \
          | grep -E '^serve/|Error' | sed "s/^/warmup=$w #$r: /"
      done
    done
    cp "$OUT/serve/true-2/suite.json" "$OUT/serve-suite.json"; rm -rf "$OUT/serve" ;;
  thirtyeighth-b)  # the full suite's multi-stream cases ($ROUTING, default uniform; $BUDGETS, default all: b*) with
                   # the warm-up that runs all of a workload's tokens, plus the 25% one-stream split and reproducible
                   # cases (issue 4's penalty), within $MS_DEADLINE s; then $SERVE serve runs (uniform only), each
                   # "<warmup>-<fresh|warm>": the warm-up on or off, on empty kernel caches or the box's; JIT_PROBE=1:
                   # then the warm-up's kernel builds timed one by one (bench/jit_probe.py); GPU_TESTS=FILES: their GPU
                   # tests first
    if [ -n "${GPU_TESTS:-}" ]; then  # these test files' GPU tests first, e.g. GPU_TESTS=tests/test_warmup.py
      timeout 200 python3 -m pytest -q -m gpu $GPU_TESTS > "$OUT/gpu_tests_b.txt" 2>&1; tail -2 "$OUT/gpu_tests_b.txt"
    fi
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    r=${ROUTING:-uniform}
    timeout $(( ${MS_DEADLINE:-520} + 40 )) python3 -m bench run --suite full --layers 12 --tokens 64 \
      --deadline "${MS_DEADLINE:-520}" --out "$OUT/ms-$r" --cases "split/b25/$r/p128x1" "repro/b25/$r/p128x1" \
      "ceiling/all/$r/p128x[48]" "split/${BUDGETS:-b*}/$r/p128x[48]" 2>&1 | grep -vE "^---" | tail -16
    rm -f "$OUT"/ms-*/*.png
    for run in ${SERVE:-}; do
      w=${run%-*}; fresh=""; [ "${run#*-}" = fresh ] && fresh=1
      STRATA_BENCH_FRESH_JIT=$fresh timeout 100 python3 -m bench run --suite full --layers 12 --deadline 95 \
        --cases 'serve/b25/uniform/startup' --set '{"runtime": {"warmup": '$w'}}' --out "$OUT/serve-$run" 2>&1 \
        | grep -E '^serve/|Error' | sed "s/^/$run: /"
      rm -f "$OUT/serve-$run"/*.png "$OUT/serve-$run"/serve.*
    done
    if [ -n "${JIT_PROBE:-}" ]; then  # the kernel builds of the warm-up on empty caches (bench/jit_probe.py)
      m=$(ls -d /dev/shm/strata-suite/models/*uniform* | head -1)
      TRITON_CACHE_DIR=$(mktemp -d) CUPY_CACHE_DIR=$(mktemp -d) timeout 120 python3 bench/jit_probe.py --model "$m" \
        --out "$OUT" --config '{"tiers": {"gpu": {"budget": "3623878656"}, "disk": {"path": "/dev/shm/strata-suite/cache",
        "scrub": false}}, "runtime": {"max_context": 1024}}' 2>&1 | grep -vE "^\s*$" | tail -22
      # the decode step's builds for sm_90 on this box's CPU, by the development box's replica of its launches (the
      # same model depth and buckets as the probe above), into a cache the probe then runs on: the builds left in its
      # list are those the replica's keys missed (what a replica built during the load could not save)
      c=$(mktemp -d)
      TRITON_CACHE_DIR=$c timeout 60 python3 bench/kernel_builds.py --model --layers 12 --max-context 1024 \
        2>&1 | grep -v -i warn
      TRITON_CACHE_DIR=$c CUPY_CACHE_DIR=$(mktemp -d) timeout 120 python3 bench/jit_probe.py --model "$m" \
        --out "$OUT/jit_after_replica" --config '{"tiers": {"gpu": {"budget": "3623878656"}, "disk": {"path":
        "/dev/shm/strata-suite/cache", "scrub": false}}, "runtime": {"max_context": 1024}}' 2>&1 | grep -vE "^\s*$" \
        | tail -22 | sed "s/^/after the replica: /"
    fi ;;
  cap-summary)  # after twentyeighth and twentyeighth-b (run apart, so that a timed-out A/B still leaves its summary;
                # "cap" in the directory names is the switch's value: the cap, or $STRATA_CPU_PIN)
    python3 - "$OUT" <<'PY'  # one file of every run's case record (the box returns few files), a line each
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); runs = {}
for p in sorted(out.glob("b*-cap*-*/suite.json")):
    c = json.load(open(p))["cases"][0]; runs[p.parent.name] = c; m = c["metrics"]
    print(p.parent.name, m["decode_tok_s"], c.get("fraction_of_roofline"), "hit", m["gpu_hit_rate"],
          "promo/tok", m["promotions_per_token"], "window", m.get("mailbox_window"))
json.dump(runs, open(out / "cap_ab.json", "w"), indent=1)
PY
    rm -rf "$OUT"/b*-cap*-* ;;
  engram)
    timeout 280 python3 bench/engram.py --out "$OUT/engram" --model-dir /dev/shm/engram --steps 200 2>&1 | tail -14 ;;
  *)  # an earlier session's mode (bench/h200_past_sessions.sh, which sees the helpers above), else unknown
    # shellcheck source=bench/h200_past_sessions.sh
    . "$(dirname "${BASH_SOURCE[0]}")/h200_past_sessions.sh"
    past_mode_unknown=; past_session_mode "$@"; rc=$?
    [ -z "$past_mode_unknown" ] || echo "bench/h200_session.sh: unknown mode '$1' (the modes: this script's header;" \
      "the earlier sessions': bench/h200_past_sessions.sh)" >&2
    exit "$rc" ;;
esac

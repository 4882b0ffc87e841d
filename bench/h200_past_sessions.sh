# shellcheck shell=bash
# The finished sessions' modes of bench/h200_session.sh (eleventh ... thirtysixth-c), which bench/RESULTS.md quotes as
# `bash bench/h200_session.sh <mode>`: sourced by h200_session.sh for a mode it lacks, which calls
# past_session_mode "$@" (not run on its own). The branches are as they were in h200_session.sh: $0 is still
# h200_session.sh (`bash "$0" <mode>` runs a mode of either file), $2 ... its arguments, $OUT, the environment and its
# helpers (gpu_tests, prefill_run, ab_case, ab_summary: defined before this file is sourced) as there. An unknown mode
# sets past_mode_unknown and returns 2 (a mode's own last command may end with any status, 2 among them).
# Modes that set $STRATA_MAILBOX_BOOKS or $STRATA_MAILBOX_SHARE_ADAPT (thirty-fifth and thirty-sixth sessions) no
# longer A/B anything: b1d8bde removed those switches, so each of their arms now runs the default code.
# The 12-layer skewed checkpoint with temporal locality at /dev/shm/loc1, unless it is there
make_loc1() {
  [ -d /dev/shm/loc1 ] || python3 -m strata demo-model /dev/shm/loc1 --size bench --layers 12 --no-engram \
    --route-skew 1.0 --route-locality 1 > /dev/null 2>&1
}
# bench/hotpath.py on the 12-layer skewed checkpoint with temporal locality (made once), 25% of the expert bytes in
# VRAM, 128 tokens a case; $1 = cases. One summary line a case (the whole record in $OUT/hp/hotpath.json).
loc1_hotpath() {
  make_loc1
  timeout "${HP_TIMEOUT:-200}" python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hp" --tokens 128 \
    --gpu-fraction "${HP_FRACTION:-0.25}" --cases "$1" 2>&1 | grep -E '^\{"|Error' | python3 -c "import json, sys
for line in sys.stdin:
    if not line.startswith('{'): print(line.strip()); continue
    r = json.loads(line); k, ca, mb = r.get('cpu_kernel_us', {}), r.get('copy_ahead', {}), r['mailbox_us_per_layer']
    print(r['case'], r['tok_s'], 'share', r.get('gpu_share'), 'kernel', k, 'threads', r.get('cpu_kernel_threads_us'), 'serve/gap', mb['serve'],
          mb['gpu_gap'], 'plans', ca.get('plans_used'), 'read/computed MB/tok', ca.get('read_MB_per_token'),
          ca.get('computed_MB_per_token'), 'stolen', ca.get('pieces_stolen'), 'held_max', ca.get('held_us_max'))"
}
# bench/serial_phase.py on the 12-layer skewed checkpoint with temporal locality (made here, removed after: the suite's
# pinned tier needs that RAM), into $OUT/sp and $OUT/sp.txt; $1 = timeout s, $2 = the lines of sp.txt shown (a regex)
loc1_serial_phase() {
  make_loc1
  timeout "$1" python3 bench/serial_phase.py --model /dev/shm/loc1 --out "$OUT/sp" --cases "${SP_CASES:-split}" \
    > "$OUT/sp.txt" 2>&1; grep -E "$2" "$OUT/sp.txt"
  rm -rf /dev/shm/loc1
}
# The suite's skewed case at a GPU budget of $1 percent with promotions on (the default) and off, alternated (REPS
# rounds), into $OUT/ab/promote-<true|false>-<round>
promote_ab() {
  for r in $(seq "${REPS:-1}"); do
    for p in true false; do
      ab_case "promote-$p-$r" "split/b$1/skewed/p128x1" --set '{"policy": {"promote": '$p'}}'
    done
  done
}
# One run of the suite's skewed 25% case into $OUT/$1 (its suite.json kept); the rest of the arguments go to
# `bench run` (e.g. --set '{...}'); knobs in the environment apply to the run.
b25_suite() {
  local out="$OUT/$1"; shift
  timeout 70 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 60 --cases 'split/b25/skewed/p128x1' \
    --out "$out" "$@" 2>&1 | grep -E '^split/'
  rm -f "$out"/*.png "$out"/*.md
}
past_session_mode() {
case "$1" in
  thirteenth)  # the thirteenth session's first call: the GPU tests of the twelfth session's review commit (the handshake's
               # own gather view, the kernel pool without parking), then the Engram bench on real text and on Zipf tokens
    timeout 150 python3 -m pytest -q -m gpu tests/test_engram_handshake.py tests/test_engram.py tests/test_decode_path.py tests/test_decode_graphs.py \
      tests/test_cpu_mailbox.py tests/test_tier_primitives.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    bash "$0" engram-text
    timeout 150 python3 bench/engram.py --out "$OUT/engram-zipf" --model-dir /dev/shm/engram --steps 200 \
      --cases gpu,disk 2>&1 | tail -4 | cut -c1-400 ;;
  thirteenth-b)  # the full suite's cases the quick run lacks (12 layers, 64 tokens: merged with the quick run's JSON):
                 # the uniform multi-stream cases again (now warmed per batch shape), the skewed grid and disk case;
                 # then the Engram bench on source code (transformers' own files) as a second real text
    B="python3 -m bench run --suite full --layers 12 --tokens 64"
    timeout 150 $B --deadline 130 --out "$OUT/full-uniform-streams" --cases 'ceiling/*/uniform/p128x[48]' \
      'split/*/uniform/p128x[48]' 2>&1 | grep -E '^(ceiling|split|wrote)' | cut -c1-200
    timeout 300 $B --deadline 270 --out "$OUT/full-skewed" --cases 'ceiling/*/skewed/*' 'split/b10/skewed/*' \
      'split/b25/skewed/p128x[48]' 'split/b25/skewed/p8192x1' 'split/b50/skewed/*' 'disk/*/skewed/*' 2>&1 \
      | grep -E '^(ceiling|split|disk|wrote)' | cut -c1-200
    T=$(python3 -c "import transformers, os; print(os.path.dirname(transformers.__file__))")
    timeout 110 python3 bench/engram.py --out "$OUT/engram-code" --model-dir /dev/shm/engram --steps 200 \
      --text "$T/modeling_utils.py,$T/generation/utils.py,$T/trainer.py" --prime 8000 --cases gpu,disk 2>&1 | tail -3 | cut -c1-300 ;;
  thirteenth-c)  # the 8K-prompt uniform cases again (calls 2 and 3 captured the 8K bucket's graphs inside their timing),
                 # and transformers + accelerate on the skewed checkpoint beside the skewed split, in one run
    timeout 420 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 330 --hf-limit 150 \
      --out "$OUT/full-8k-hf" --cases 'ceiling/*/uniform/p8192x1' 'split/*/uniform/p8192x1' 'split/b25/skewed/p128x1' \
      'hf/b25/skewed/*' 2>&1 | grep -E '^(ceiling|split|hf|wrote)' | cut -c1-200 ;;
  fourteenth)  # the fourteenth session's first call: the GPU tests of the last session's moves (CpuCompute, review),
                # then the skewed 8K prefill probe with prefetch and promotions toggled one at a time
    timeout 200 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_decode_path.py tests/test_decode_graphs.py tests/test_grouped_prefill.py \
      tests/test_engram_handshake.py tests/test_gpu_tiers.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    bash "$0" prefill-skew
    b='"tiers": {"gpu": {"budget": "1.12GiB"}}'
    for v in 'nopf:"prefetch": {"lookahead": 0}' 'nopromote:"policy": {"promote": false}' \
             'loop:"runtime": {"grouped_prefill": false}'; do
      timeout 60 python3 bench/profile_prefill.py --model /dev/shm/b4-1.0 --label "split-1.0-${v%%:*}" \
        --config "{$b, ${v#*:}}" --out "$OUT" 2>&1 | grep prefilled
    done ;;
  fourteenth-b)  # the fix (a prompt's CPU share ships only its tokens' rows): its GPU tests, the 4-layer probe again, then
                  # the suite's 8K-prompt cases on both routings (12 layers, 64 tokens), for the merged report
    timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_tiers.py tests/test_grouped_prefill.py > "$OUT/gpu_tests.txt" 2>&1
    tail -2 "$OUT/gpu_tests.txt"
    bash "$0" prefill-skew
    timeout 400 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 370 --out "$OUT/full-8k" \
      --cases 'ceiling/*/*/p8192x1' 'split/*/*/p8192x1' 2>&1 | grep -E '^(ceiling|split|wrote)' | cut -c1-200 ;;
  fourteenth-c)  # ran once with prefetch.prompt_ahead (a long prompt's next layer prefetched while this one computed;
                  # slower, removed): the suite's 8K split cases, then the 12-layer checkpoints at 25% with it on/off
    timeout 330 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 300 --out "$OUT/full-8k-ahead" \
      --cases 'split/*/*/p8192x1' 2>&1 | grep -E '^(split|wrote)' | cut -c1-200 ;;
  fifteenth)  # ran once, with code ead0f1f (prefill_keeps_resident then off by default): the GPU tests, then an 8K
               # prompt at the default chunk ("auto": then 5,120 for the bench model), one 8,192 chunk, residents kept
    gpu_tests
    for r in uniform 1.0; do
      python3 -m strata demo-model /dev/shm/b4-$r --size bench --layers 4 --no-engram --route-skew $r > /dev/null 2>&1
      prefill_run /dev/shm/b4-$r "default-1-$r" -1 1.12 false
      prefill_run /dev/shm/b4-$r "default8192-$r" 8192 1.12 false
      prefill_run /dev/shm/b4-$r "keep-$r" 0 1.12 true
    done ;;
  fifteenth-b)  # the GPU tests of the prefill's pair buffer and double-buffered stream slots, then the 8K prompt at
                 # 25%: "auto" chunk, one 8,192 chunk, residents kept (4 layers, both routings; 12 layers, uniform)
    timeout 150 python3 -m pytest -q -m gpu tests/test_grouped_prefill.py tests/test_gpu_tiers.py tests/test_step_copies.py \
      tests/test_decode_path.py tests/test_decode_graphs.py tests/test_prefill_residents.py > "$OUT/gpu_tests_b.txt" 2>&1; tail -2 "$OUT/gpu_tests_b.txt"
    for r in uniform 1.0; do
      python3 -m strata demo-model /dev/shm/b4-$r --size bench --layers 4 --no-engram --route-skew $r > /dev/null 2>&1
      prefill_run /dev/shm/b4-$r "b-default-1-$r" -1 1.12 false
      prefill_run /dev/shm/b4-$r "b-default8192-$r" 8192 1.12 false
      prefill_run /dev/shm/b4-$r "b-keep-$r" 0 1.12 true
      rm -rf /dev/shm/b4-$r
    done
    python3 -m strata demo-model /dev/shm/b12-uniform --size bench --layers 12 --no-engram --route-skew uniform > /dev/null 2>&1
    for keep in false true; do prefill_run /dev/shm/b12-uniform "b12-keep$keep" 0 3.6 $keep; done ;;
  fifteenth-c)  # the prefill's pairs known per batch (no sort, no sync), GEMMs in pieces, "auto" chunk now 8,192: the
                 # GPU tests, then an 8K prompt at 25% with and without the residents kept (12 layers; 4 both routings)
    timeout 150 python3 -m pytest -q -m gpu tests/test_grouped_prefill.py tests/test_gpu_tiers.py tests/test_step_copies.py \
      tests/test_prefill_residents.py > "$OUT/gpu_tests_c.txt" 2>&1; tail -2 "$OUT/gpu_tests_c.txt"
    for m in b12-uniform:3.6 b4-uniform:1.12 b4-1.0:1.12; do
      name=${m%%:*}; n=${name%%-*}; r=${name#*-}
      python3 -m strata demo-model /dev/shm/$name --size bench --layers ${n#b} --no-engram --route-skew $r > /dev/null 2>&1
      for keep in false true; do prefill_run /dev/shm/$name "c-$name-keep$keep" -1 "${m#*:}" $keep; done
      rm -rf /dev/shm/$name
    done ;;
  eleventh)  # the eleventh session's first call: its unrun GPU tests, the GPU share rule, the engine-side kernel probe
    timeout 150 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_grouped_prefill.py tests/test_decode_path.py tests/test_decode_graphs.py \
      > "$OUT/gpu_tests_next.txt" 2>&1; tail -3 "$OUT/gpu_tests_next.txt"
    export PREFILL=0
    timeout 200 bash "$0" hotpath uniform "ceiling,split,split+share0"
    timeout 120 python3 bench/mailbox_probe.py --model /dev/shm/b12-uniform --replays 20 --out "$OUT/mailbox-engine" 2>&1 | tail -8
    timeout 150 bash "$0" hotpath 1.0 "split,split+again" ;;
  sixteenth)  # overlapped decode (runtime.overlap_decode): the GPU tests, then skewed cases with and without it
    bash "$0" tests
    PREFILL=0 timeout 270 bash "$0" hotpath 1.0 "${2:-ceiling,ceiling+sync,split,split+sync,split+again}" ;;
  seventeenth)  # experts split by rows between the worker and the GPU's in-place read: every GPU test, then the A/B
    bash "$0" tests
    PREFILL=0 timeout 200 bash "$0" hotpath 1.0 "${2:-ceiling,split,split+whole,split+again,split+whole+again}"
    PREFILL=0 timeout 120 bash "$0" hotpath uniform "${3:-split,split+whole}" ;;
  seventeenth-b)  # one fused kernel for a mailbox layer's share split and inbox: its GPU tests, then the A/B on both routings
    timeout 200 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_decode_path.py tests/test_decode_graphs.py tests/test_overlap_decode.py \
      tests/test_gpu.py > "$OUT/gpu_tests_b.txt" 2>&1; tail -3 "$OUT/gpu_tests_b.txt"
    PREFILL=0 timeout 200 bash "$0" hotpath 1.0 "${2:-split,split+torchbox,split+again,split+torchbox+again}"
    PREFILL=0 timeout 130 bash "$0" hotpath uniform "${3:-split,split+torchbox}" ;;
  eighteenth)  # the mailbox without copy nodes (inbox and `ready` written by the pack kernel, the answer read by the
    # wait kernel): the GPU tests of the mailbox and decode paths, the round trip alone both ways, the A/B on both routings
    timeout 200 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_decode_path.py tests/test_decode_graphs.py tests/test_overlap_decode.py \
      > "$OUT/gpu_tests_18.txt" 2>&1; tail -3 "$OUT/gpu_tests_18.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_18.txt" | head
    for d in 1 0; do STRATA_MAILBOX_DIRECT=$d timeout 60 python3 bench/mailbox_probe.py --threads 12 \
      --out "$OUT/mailbox-direct$d" 2>&1 | grep cold_experts | cut -c1-160 | sed "s/^/direct=$d: /"; done
    PREFILL=0 timeout 170 bash "$0" hotpath 1.0 "${2:-split,split+copybox,split+again,split+copybox+again}"
    PREFILL=0 timeout 110 bash "$0" hotpath uniform "${3:-split,split+copybox}" ;;
  eighteenth-b)  # the resident pairs beside the worker (after the layer is posted; the in-place share on a second
    # stream): the GPU tests of the mailbox and decode paths, then the A/B on both routings and a share sweep
    timeout 200 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_decode_path.py tests/test_decode_graphs.py tests/test_overlap_decode.py \
      > "$OUT/gpu_tests_18b.txt" 2>&1; tail -3 "$OUT/gpu_tests_18b.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_18b.txt" | head
    PREFILL=0 timeout 230 bash "$0" hotpath 1.0 "${2:-split,split+hotbefore,split+again,split+hotbefore+again,split+share0.25,split+share0.55}"
    PREFILL=0 timeout 110 bash "$0" hotpath uniform "${3:-split,split+hotbefore}" ;;
  eighteenth-c)  # the resident pairs' order again (reversed run order), then the serve start-up (fastapi 0.165 needs the
    # opentelemetry-api wheel) and the b25 split cases a second time (call 3 was the whole quick suite)
    PREFILL=0 timeout 200 bash "$0" hotpath 1.0 "${2:-split+hotbefore,split,split+hotbefore+again,split+again}"
    PREFILL=0 timeout 110 bash "$0" hotpath uniform "${3:-split+hotbefore,split}"
    rm -rf /dev/shm/b12* /dev/shm/sc
    timeout 220 python3 -m bench run --suite quick --deadline 200 --out "$OUT/suite-b" --cases serve/b25/uniform/startup \
      split/b25/uniform/p128x1 split/b25/skewed/p128x1 2>&1 | grep -v "^---" | tail -5 ;;
  nineteenth)  # where a one-stream layer's GPU time goes (kernel tables of the all-in-VRAM and the skewed split step,
    # CUDA graphs on), then the resident pairs' order under batched decode (4 and 8 streams, skewed, 25%)
    python3 -m strata demo-model /dev/shm/b12-1.0 --size bench --layers 12 --no-engram --route-skew 1.0 > /dev/null 2>&1
    timeout 100 python3 bench/profile_decode.py --model /dev/shm/b12-1.0 --no-kernels --tokens 32 \
      --out "$OUT/profile-ceiling" 2>&1 | grep -E "tok/s"
    timeout 120 python3 bench/profile_decode.py --model /dev/shm/b12-1.0 --no-kernels --tokens 32 --out "$OUT/profile-split" \
      --config '{"tiers": {"gpu": {"budget": "3623878656"}, "disk": {"path": "/dev/shm/sc", "scrub": false}}}' 2>&1 | grep -E "tok/s"
    rm -rf /dev/shm/b12* /dev/shm/sc
    B="python3 -m bench run --suite full --layers 12 --tokens 64"
    for v in 1 0; do STRATA_MAILBOX_HOT_ALONGSIDE=$v timeout 150 $B --deadline 130 --out "$OUT/streams-alongside$v-$RANDOM" \
      --cases 'split/b25/skewed/p128x[48]' 2>&1 | grep -E '^split' | cut -c1-200 | sed "s/^/alongside=$v: /"; done ;;
  nineteenth-b)  # the one-launch decode router and the residual folded into the combine: the GPU tests of the decode
    # kernels and paths, the ceiling's kernel table again, then the A/B on both routings
    timeout 230 python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_gpu.py tests/test_gpu_tiers.py \
      tests/test_decode_path.py tests/test_decode_graphs.py tests/test_cpu_mailbox.py tests/test_overlap_decode.py > "$OUT/gpu_tests_19b.txt" 2>&1
    tail -3 "$OUT/gpu_tests_19b.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_19b.txt" | head
    python3 -m strata demo-model /dev/shm/b12-1.0 --size bench --layers 12 --no-engram --route-skew 1.0 > /dev/null 2>&1
    timeout 60 python3 bench/profile_decode.py --model /dev/shm/b12-1.0 --no-kernels --tokens 32 \
      --out "$OUT/profile-ceiling" 2>&1 | grep -E "tok/s"
    PREFILL=0 timeout 150 bash "$0" hotpath 1.0 "${2:-ceiling,ceiling+norouter+noresidual,split,split+norouter+noresidual,split+again}"
    PREFILL=0 timeout 100 bash "$0" hotpath uniform "${3:-split,split+norouter+noresidual}" ;;
  nineteenth-c)  # every GPU test at this code (kvikio's rapids-logger wheel now carried), then the suite's 25% cases at one
    # stream with the uniform ablations that were last measured in run B (cfcce9b), all in one run for their ratios
    gpu_tests
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head
    rm -rf /dev/shm/b12* /dev/shm/sc
    timeout 310 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 290 --out "$OUT/suite-b25" --cases \
      'ceiling/all/uniform/p128x1' 'split/b25/*/p128x1' 'copy-only/b25/uniform/p128x1' 'cpu-only/b0/uniform/p128x1' \
      'no-prefetch/b25/uniform/p128x1' 'static/b25/uniform/p128x1' 'naive/b25/uniform/p128x1' 2>&1 | grep -E '^[a-z-]+/' \
      | cut -c1-200 ;;
  nineteenth-d)  # the router's top-k in one warp with one reduction a round: its GPU tests, the ceiling's kernel table,
    # the A/B on skewed routing
    timeout 150 python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_decode_path.py tests/test_decode_graphs.py > "$OUT/gpu_tests_19d.txt" 2>&1
    tail -2 "$OUT/gpu_tests_19d.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_19d.txt" | head
    python3 -m strata demo-model /dev/shm/b12-1.0 --size bench --layers 12 --no-engram --route-skew 1.0 > /dev/null 2>&1
    timeout 60 python3 bench/profile_decode.py --model /dev/shm/b12-1.0 --no-kernels --tokens 32 \
      --out "$OUT/profile-ceiling" 2>&1 | grep -E "tok/s"
    PREFILL=0 timeout 150 bash "$0" hotpath 1.0 "${2:-ceiling,ceiling+norouter,ceiling+again,split,split+norouter}" ;;
  twentieth)  # where the CPU kernel's ~30 us fixed cost a call goes (its phase trace, alone, then inside decode),
    # and its threads reading down chunks ahead while the gate/up phase finishes
    timeout 120 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_cpu_experts.py > "$OUT/gpu_tests_20.txt" 2>&1
    tail -2 "$OUT/gpu_tests_20.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_20.txt" | head
    timeout 150 python3 bench/cpu_kernel_trace.py --threads 12 --calls 400 --out "$OUT/ckt" \
      --knobs "${2:-claim_ahead=0;claim_ahead=4;claim_ahead=16;claim_ahead=0,chunk_div=16;claim_ahead=4,chunk_div=16}" 2>&1 | tail -40
    PREFILL=0 timeout 220 bash "$0" hotpath 1.0 "${3:-split,split+claim4,split+whole,split+again,split+claim4+again,split+claim16}"
    PREFILL=0 timeout 100 bash "$0" hotpath uniform "${4:-split,split+claim4}" ;;
  twentieth-b)  # the down rows read two streams a thread: the kernel's phase trace alone, then the A/B in decode
    timeout 100 python3 -m pytest -q -m gpu tests/test_cpu_experts.py tests/test_cpu_mailbox.py 2>&1 | tail -1
    timeout 150 python3 bench/cpu_kernel_trace.py --threads 12 --calls 400 --out "$OUT/ckt" \
      --knobs "${2:-down_split=0;down_split=1;down_split=1,claim_ahead=4;down_split=0,claim_ahead=4}" 2>&1 | tail -30
    PREFILL=0 timeout 240 bash "$0" hotpath 1.0 "${3:-split,split+dsplit,split+dsplit+claim4,split+again,split+dsplit+again,split+dsplit+claim4+again}"
    PREFILL=0 timeout 120 bash "$0" hotpath uniform "${4:-split,split+dsplit,split+again,split+dsplit+again}" ;;
  twentieth-c)  # the kernel's new defaults (claim_ahead=4, down_split=1) against the old (claim0+dsplit0), alternated,
    # then the suite's one-stream 25% split cases (run P)
    timeout 100 python3 -m pytest -q -m gpu tests/test_cpu_experts.py tests/test_cpu_mailbox.py 2>&1 | tail -1
    PREFILL=0 timeout 200 bash "$0" hotpath 1.0 "${2:-split,split+claim0+dsplit0,split+again,split+claim0+dsplit0+again,split+again,split+claim0+dsplit0+again}"
    PREFILL=0 timeout 130 bash "$0" hotpath uniform "${3:-split,split+claim0+dsplit0,split+again,split+claim0+dsplit0+again}"
    rm -rf /dev/shm/b12* /dev/shm/sc
    timeout 200 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 180 --out "$OUT/suite-b25" --cases \
      'split/b25/*/p128x1' 2>&1 | grep -E '^[a-z-]+/' | cut -c1-200 ;;
  twentieth-d)  # the resident pairs beside the worker or before it, batched (8 streams, skewed, 25%), alternated twice
    rm -rf /dev/shm/b12* /dev/shm/sc
    for v in 1 0 1 0; do STRATA_MAILBOX_HOT_ALONGSIDE=$v timeout 140 python3 -m bench run --suite full --layers 12 --tokens 64 \
      --deadline 120 --out "$OUT/x8-alongside$v-$RANDOM" --cases 'split/b25/skewed/p128x8' 2>&1 | grep -E '^split' | cut -c1-200 \
      | sed "s/^/alongside=$v: /"; done ;;
  twentyfirst)  # the code moved after the twentieth session's last GPU call (the CPU kernel's pool and emulations in
    # their own headers, the graph tests in their own file): every GPU test, then the kernel's phases and the A/B
    timeout 280 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head
    timeout 100 python3 bench/cpu_kernel_trace.py --threads 12 --calls 400 --out "$OUT/ckt" 2>&1 | tail -20
    PREFILL=0 timeout 150 bash "$0" hotpath 1.0 "${2:-split,split+claim0+dsplit0,split+again,split+claim0+dsplit0+again}" ;;
  twentyfirst-b)  # the decode GEMV for the attention projections: every GPU test, its probe and tile sweep, the A/B
    timeout 150 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head
    timeout 240 python3 bench/gemv_probe.py --out "$OUT/gemv" ${SWEEP---sweep} 2>&1 | cut -c1-700
    PREFILL=0 timeout 170 bash "$0" hotpath 1.0 "${2:-ceiling,ceiling+nogemv,split,split+nogemv,ceiling+again,split+again}" ;;
  twentysecond)  # the decode GEMV at one row with the sweep's tiles: every GPU test, the probe, the A/B alternated
    timeout 150 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head
    timeout 150 python3 bench/gemv_probe.py --out "$OUT/gemv" ${SWEEP---sweep} 2>&1 | cut -c1-400
    PREFILL=0 timeout 260 bash "$0" hotpath 1.0 "${2:-ceiling,ceiling+nogemv,split,split+nogemv,ceiling+again,ceiling+nogemv+again,split+again,split+nogemv+again}" ;;
  twentysecond-b)  # the probe at the sweep's new winners, then the A/B on the full 48-layer model all in VRAM
    timeout 60 python3 bench/gemv_probe.py --out "$OUT/gemv" 2>&1 | cut -c1-300
    [ -d /dev/shm/b48 ] || timeout 300 python3 -m strata demo-model /dev/shm/b48 --size bench --no-engram 2>&1 | tail -2
    timeout 280 python3 bench/hotpath.py --model /dev/shm/b48 --tokens 64 --prefill 0 --out "$OUT/b48" \
      --cases "${2:-ceiling,ceiling+nogemv,ceiling+again,ceiling+nogemv+again}" 2>&1 | grep '^{"' | cut -c1-300 ;;
  twentythird)  # the pair kernels' new launch configurations against the old on the split, alternated (the ceiling: +1.4%)
    PREFILL=0 timeout 330 bash "$0" hotpath 1.0 "${2:-split+oldpairs,split,split+oldpairs+again,split+again}" ;;
  twentythird-b)  # the skewed checkpoint with temporal locality (--route-locality 1): its routing, hit rates and split
    timeout 500 python3 -m bench run --suite quick --locality 1 --deadline 480 --out "$OUT/suite-loc1" \
      --cases 'ceiling/all/skewed/p128x1' 'split/b25/skewed/p128x1' 'split/b40/skewed/p128x1' 2>&1 | grep -v '^INFO' | tail -6 ;;
  twentyfourth)  # copy-ahead (strata.runtime.copy_ahead): its GPU tests, then the skewed split with it and without, alternated
    timeout 250 python3 -m pytest -q -m gpu tests/test_copy_ahead.py tests/test_cpu_mailbox.py tests/test_decode_path.py \
      tests/test_gpu_tiers.py > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"
    PREFILL=0 timeout 330 bash "$0" hotpath 1.0 "${2:-split+noahead,split,split+noahead+again,split+again,split+ahead1600000,split+ahead4700000}" ;;
  twentyfourth-b)  # copy-ahead's word copy: the kernel alone, its GPU tests, the budget swept on the skewed split
    timeout 90 python3 bench/copy_ahead_probe.py --out "$OUT/probe" 2>&1 | tail -14
    timeout 120 python3 -m pytest -q -m gpu tests/test_copy_ahead.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    PREFILL=0 timeout 300 bash "$0" hotpath 1.0 "split+noahead,split,split+ahead1572864,split+ahead2359296,split+ahead3145728,split+noahead+again,split+again" ;;
  twentyfourth-c)  # run T: the suite's 25% cases (temporal locality now its default), the 40% skewed and naive, with copy-ahead
    rm -rf /dev/shm/b12-* /dev/shm/sc
    timeout 420 python3 -m bench run --suite quick --deadline 400 --out "$OUT/suite-t" --cases 'split/b25/*/p128x1' \
      'split/b40/skewed/p128x1' 'naive/b25/skewed/p128x1' 2>&1 | grep -v '^INFO' | tail -9 ;;
  twentyfifth)  # copy-ahead (off by default now) on the temporal-locality checkpoint, alternated 3 x 2 (call 6 ran 2 x 2)
    python3 -m strata demo-model /dev/shm/loc1 --size bench --layers 12 --no-engram --route-skew 1.0 --route-locality 1 \
      > /dev/null 2>&1
    timeout 330 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hotpath-loc1" --tokens 64 \
      --prefill 0 --cases "${2:-split,split+ahead,split+again,split+ahead+again,split+again,split+ahead+again}" \
      2>&1 | grep -E "^\{'case'" | cut -c1-700 ;;  # (each case as it ends: a hang loses only the later ones)
  twentyfifth-a)  # the twenty-fifth session's first call: copy-engine tail copies alone, the GPU tests of the last
                  # session's review refactor, then the alternated copy-ahead A/B on the temporal-locality checkpoint
    timeout 90 python3 bench/dma_tail_probe.py --out "$OUT/dma" 2>&1 | tail -32 | cut -c1-200
    timeout 200 python3 -m pytest -q -m gpu tests/test_copy_ahead.py tests/test_cpu_mailbox.py > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
    bash "$0" twentyfifth ;;
  twentyfifth-b)  # copy-ahead on the copy engine (the worker issues the tail copies; csrc/mailbox_ahead.h): its GPU
                  # tests, then the A/B on the temporal-locality checkpoint (default budget 3 granules; 2 and 4; SM)
    timeout 200 python3 -m pytest -q -m gpu tests/test_copy_ahead.py tests/test_cpu_mailbox.py > "$OUT/gpu_tests.txt" 2>&1
    tail -3 "$OUT/gpu_tests.txt"
    bash "$0" twentyfifth "${2:-split,split+ahead,split+ahead3145728,split+again,split+ahead+again}" ;;
  twentyseventh)  # the twenty-sixth session's review mends under every GPU test, then the suite's skewed 25% case
                  # twice (64 tokens a stream now; mailbox_window: the worker's trip over the decode window alone)
    timeout 300 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"
    for r in 1 2; do timeout 200 python3 -m bench run --suite quick --deadline 180 --cases 'split/b25/skewed/p128x1' \
      --out "$OUT/suite-skewed-$r" 2>&1 | tail -3; done ;;
  twentyseventh-b)  # the combine that applies the next norm and waits for the worker itself (strata.kernels.combine_norm):
                    # every GPU test, then the all-in-VRAM A/B (+nonorm) and the skewed split A/B (+nonorm+nowait).
                    # A record of call 2 at 83d8b05: the fold and its modifiers were backed out in 77f8784
    timeout 300 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"
    python3 -m strata demo-model /dev/shm/loc1 --size bench --layers 12 --no-engram --route-skew 1.0 --route-locality 1 \
      > /dev/null 2>&1
    timeout 150 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hotpath-ceiling" --tokens 256 \
      --prefill 0 --cases "ceiling,ceiling+nonorm,ceiling+again,ceiling+nonorm+again,ceiling+again,ceiling+nonorm+again" \
      2>&1 | grep -E "^\{'case'" | cut -c1-300
    timeout 200 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hotpath-loc1" --tokens 128 \
      --prefill 0 --cases "${2:-split,split+nonorm+nowait,split+again,split+nonorm+nowait+again,split+again,split+nonorm+nowait+again}" \
      2>&1 | grep -E "^\{'case'" | cut -c1-700 ;;
  twentyseventh-c)  # the 40% skewed suite case, whose steps' ends grew with its post-prompt promotions (run Z), with
                    # $STRATA_PROMOTIONS_PER_STEP=1 and without, alternated 3 x 2 (a record: the cap lost in the
                    # twenty-eighth session and was removed, so both halves now run the same code)
    for r in 1 2 3; do
      for cap in 0 1; do STRATA_PROMOTIONS_PER_STEP=$cap timeout 200 python3 -m bench run --suite quick --deadline 180 \
        --cases 'split/b40/skewed/p128x1' --out "$OUT/b40-cap$cap-$r" 2>&1 | grep -E '^split/'; done
    done ;;
  twentyeighth)  # the promotions cap on both skewed suite cases: 40% 3 x 2, then 25% 2 x 2, alternated (a record)
    bash "$0" twentyseventh-c
    for r in 1 2; do
      for cap in 0 1; do STRATA_PROMOTIONS_PER_STEP=$cap timeout 200 python3 -m bench run --suite quick --deadline 180 \
        --cases 'split/b25/skewed/p128x1' --out "$OUT/b25-cap$cap-$r" 2>&1 | grep -E '^split/'; done
    done ;;
  twentyeighth-b)  # $STRATA_CPU_PIN=1 (the kernel's threads on cores of their own) against the default: the mailbox's
                  # GPU tests pinned, then the skewed 25% suite case 3 x 2 and the uniform one 1 x 2, alternated
                  # (a record: no gain, the switch was removed; its code is aacda9e)
    STRATA_CPU_PIN=1 timeout 120 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_cpu_pinning.py 2>&1 | tail -2
    for r in 1 2 3; do
      for pin in 0 1; do STRATA_CPU_PIN=$pin timeout 150 python3 -m bench run --suite quick --deadline 120 \
        --cases 'split/b25/skewed/p128x1' --out "$OUT/bsk-cap$pin-$r" 2>&1 | grep -E '^split/'; done
    done
    for pin in 0 1; do STRATA_CPU_PIN=$pin timeout 150 python3 -m bench run --suite quick --deadline 120 \
      --cases 'split/b25/uniform/p128x1' --out "$OUT/bun-cap$pin-1" 2>&1 | grep -E '^split/'; done ;;
  twentyninth)  # for the next session: every GPU test at the session's code, then why skewed decode stops gaining
                # above 25% (run AE: the step's ends grow to 0.73 / 1.19 ms at 40 / 50%): bench/step_timeline.py on
                # the suite's skewed checkpoint with the books and the promotions off, at 50% and 25%, and the 50%
                # suite case with promotions off, alternated 2 x 2
    gpu_tests
    make_loc1
    for f in 0.5 0.25; do
      timeout 150 python3 bench/step_timeline.py --model /dev/shm/loc1 --gpu-fraction $f --tokens 64 --out "$OUT/tl-$f" \
        --cases split,split+nobooks,split+nopromote,split+nobooks+nopromote 2>&1 | grep -E '^\{"case"|Error' | cut -c1-900
    done
    for r in 1 2; do
      for promote in true false; do timeout 150 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 120 \
        --set '{"policy": {"promote": '$promote'}}' --cases 'split/b50/skewed/p128x1' --out "$OUT/b50-promote-$promote-$r" \
        2>&1 | grep -E '^split/'; rm -f "$OUT/b50-promote-$promote-$r"/*.png "$OUT/b50-promote-$promote-$r"/*.md; done
    done ;;
  twentyninth-b)  # after twentyninth's timeline (books and promotions lengthen the steps' ends): the books woken once
                  # the step's LM head is queued (new) against at the replay (+wakeatlaunch), the kernel on 10 threads,
                  # promotions off; then the 25% suite case with promotions on and off, alternated 2 x 2
    make_loc1
    timeout 200 python3 bench/step_timeline.py --model /dev/shm/loc1 --gpu-fraction 0.25 --tokens 128 --out "$OUT/tl-0.25" \
      --cases split,split+wakeatlaunch,split+nopromote,split+t10,split,split+wakeatlaunch 2>&1 | grep -E '^\{"case"|Error' | cut -c1-1100
    timeout 80 python3 bench/step_timeline.py --model /dev/shm/loc1 --gpu-fraction 0.5 --tokens 128 --out "$OUT/tl-0.5" \
      --cases split,split+wakeatlaunch 2>&1 | grep -E '^\{"case"|Error' | cut -c1-1100
    for r in 1 2; do
      for promote in true false; do timeout 70 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 60 \
        --set '{"policy": {"promote": '$promote'}}' --cases 'split/b25/skewed/p128x1' --out "$OUT/b25-promote-$promote-$r" \
        2>&1 | grep -E '^split/'; rm -f "$OUT/b25-promote-$promote-$r"/*.png "$OUT/b25-promote-$promote-$r"/*.md; done
    done ;;
  thirtieth)  # warm-ahead (new: the mailbox worker reads the next layer's predicted cold experts' gate/up rows into its
              # threads' caches during the serial phase): its GPU tests, the kernel alone (cold against read ahead by
              # the computing threads), then the 25% skewed step timeline with and without it, alternated 2 x 2
    timeout 200 python3 -m pytest -q tests/test_warm_ahead.py tests/test_copy_ahead.py tests/test_mailbox_ahead.py \
      tests/test_cpu_mailbox.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
    timeout 100 python3 bench/cpu_kernel_trace.py --threads 12 --calls 200 --knobs "claim_ahead=4,down_split=1" --own 5 \
      --out "$OUT/ckt" 2>&1 | grep -E '^own|fixed|Error'
    make_loc1
    timeout 300 python3 bench/step_timeline.py --model /dev/shm/loc1 --gpu-fraction 0.25 --tokens 128 --out "$OUT/tl" \
      --cases split,split+warm,split,split+warm 2>&1 | grep -E '^\{"case"|Error' | cut -c1-1500 ;;
  thirtieth-b)  # warm-ahead in decode with the CPU kernel's phase trace (bench/hotpath.py), alternated 2 x 2, 25% skewed
                # (TESTS=1: the GPU tests of the files it touches first)
    [ -n "${TESTS:-}" ] && { timeout 200 python3 -m pytest -q -m gpu tests/test_warm_ahead.py tests/test_copy_ahead.py \
      tests/test_fused_kernels.py tests/test_cpu_mailbox.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"; }
    make_loc1
    timeout 400 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hp" --tokens 128 \
      --gpu-fraction 0.25 --cases "${CASES:-split,split+warm,split,split+warm}" 2>&1 | grep -E '^\{"|Error' | cut -c1-2500 ;;
  thirtieth-c)  # every GPU test at warm-ahead's default (runtime.warm_ahead = true), then the 25% skewed suite case
                # with it and without, alternated $REPS times (default 1; the suite's own JSON in $OUT/b25-warm-*)
    gpu_tests 4
    for r in $(seq "${REPS:-1}"); do
      for warm in true false; do timeout 70 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 60 \
        --set '{"runtime": {"warm_ahead": '$warm'}}' --cases 'split/b25/skewed/p128x1' --out "$OUT/b25-warm-$warm-$r" \
        2>&1 | grep -E '^split/'; rm -f "$OUT/b25-warm-$warm-$r"/*.png "$OUT/b25-warm-$warm-$r"/*.md; done
    done ;;
  thirtyfirst)  # warm-ahead's read: the kernel alone with 8 MB read ahead under each read setting (warm_streams rows at
                # once, one line in warm_touch touched), then the 25% skewed decode alternated across settings (CASES)
    timeout 150 python3 bench/cpu_kernel_trace.py --threads 12 --calls 100 --knobs "claim_ahead=4,down_split=1" --own 8 \
      --read-knobs "${READS:-warm_streams=1;warm_streams=2;warm_streams=4;warm_streams=8;warm_streams=1,warm_touch=2;warm_streams=2,warm_touch=2;warm_streams=4,warm_touch=2;warm_streams=4,warm_touch=4}" \
      --out "$OUT/ckt" 2>&1 | grep -E '^warm_|^defaults|^read|Error'
    make_loc1
    timeout 400 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hp" --tokens 128 \
      --gpu-fraction 0.25 --cases "${CASES:-split,split+ws4,split+ws4+wt2,split,split+ws4,split+ws4+wt2}" 2>&1 \
      | grep -E '^\{"|Error' | cut -c1-2500 ;;
  thirtyfirst-b)  # the kernel's new defaults (warm_streams 4, rest_chunks 1) in 25% skewed decode, alternated against
                  # each undone (rest0, ws1) and against warm-ahead off (CASES)
    make_loc1
    timeout 400 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hp" --tokens 128 \
      --gpu-fraction 0.25 --cases "${CASES:-split,split+rest0,split+ws1,split+nowarm,split,split+rest0,split+ws1,split+nowarm}" \
      2>&1 | grep -E '^\{"|Error' | cut -c1-2500 ;;
  thirtyfirst-c)  # every GPU test at the session's last code (a stopped warm read waits for no straggler), then the 25%
                  # skewed decode with warm-ahead and without (hotpath, 2 x 2), then the suite case the same way (REPS)
    gpu_tests 4
    make_loc1
    timeout "${HP_TIMEOUT:-200}" python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hp" --tokens 128 \
      --gpu-fraction 0.25 --cases "split,split+nowarm,split,split+nowarm" 2>&1 | grep -E '^\{"|Error' | cut -c1-1200
    for r in $(seq "${REPS:-1}"); do
      for warm in true false; do timeout 70 python3 -m bench run --suite full --layers 12 --tokens 64 --deadline 60 \
        --set '{"runtime": {"warm_ahead": '$warm'}}' --cases 'split/b25/skewed/p128x1' --out "$OUT/b25-warm-$warm-$r" \
        2>&1 | grep -E '^split/'; rm -f "$OUT/b25-warm-$warm-$r"/*.png "$OUT/b25-warm-$warm-$r"/*.md; done
    done ;;
  thirtysecond)  # every GPU test, then a warm piece's unread rows shared out (read_split, default) against left to its
                 # owner (rs0) in 25% skewed decode (hotpath, alternated 2 x 2), then the suite case warm on/off (REPS)
    gpu_tests 4
    loc1_hotpath "${CASES:-split,split+rs0,split,split+rs0}"
    for r in $(seq "${REPS:-1}"); do
      for warm in true false; do b25_suite "b25-warm-$warm-$r" --set '{"runtime": {"warm_ahead": '$warm'}}'; done
    done ;;
  thirtysecond-b)  # read_split on (default) against off in the suite's skewed 25% case (STRATA_CPU_TUNE, alternated,
                   # REPS pairs), then the hotpath A/B again (2 x 2)
    for r in $(seq "${REPS:-1}"); do
      for rs in 1 0; do STRATA_CPU_TUNE="read_split=$rs" b25_suite "b25-rs$rs-$r"; done
    done
    loc1_hotpath "${CASES:-split+rs0,split,split+rs0,split}" ;;
  thirtysecond-c)  # every GPU test, then the first layer read at the step's end (warm wrap, default) against not
                   # (nowrap; STRATA_WARM_WRAP=0): hotpath 2 x 2 alternated, then the suite's skewed 25% case (REPS pairs)
                   # (needs 7524785: the wrap lost and was reverted, bench/RESULTS.md, thirty-second session)
    gpu_tests 4
    loc1_hotpath "${CASES:-split,split+nowrap,split,split+nowrap}"
    for r in $(seq "${REPS:-1}"); do
      for wrap in 1 0; do STRATA_WARM_WRAP=$wrap b25_suite "b25-wrap$wrap-$r"; done
    done ;;
  thirtythird)  # every GPU test, then the split step's serial phase kernel by kernel beside the all-in-VRAM layer
                # (bench/serial_phase.py: CUPTI kernel records of 24 decode tokens, the 25% skewed checkpoint)
    gpu_tests 4
    make_loc1
    timeout 240 python3 bench/serial_phase.py --model /dev/shm/loc1 --out "$OUT/sp" --cases "${CASES:-split,ceiling}" \
      > "$OUT/sp.txt" 2>&1; tail -c 6000 "$OUT/sp.txt" ;;
  thirtythird-b)  # the GPU's in-place share of the cold rows fixed (shareX) against adapted (split), 25% skewed hotpath
                  # with warm-ahead, alternated (CASES), then the serial-phase profile again (SP_CASES)
    HP_TIMEOUT=${HP_TIMEOUT:-330} loc1_hotpath "${CASES:-split,split+share0.15,split+share0.2,split+share0.35,split,split+share0.15,split+share0.2,split+share0.35}"
    [ -z "${SP_CASES:-split,ceiling}" ] || timeout 150 python3 bench/serial_phase.py --model /dev/shm/loc1 --out "$OUT/sp" \
      --cases "${SP_CASES:-split,ceiling}" > "$OUT/sp.txt" 2>&1 ;;
  thirtythird-c)  # the serial-phase profile with the worker's own clock beside it, warm-ahead on and off (SP_CASES)
    make_loc1
    timeout 300 python3 bench/serial_phase.py --model /dev/shm/loc1 --out "$OUT/sp" \
      --cases "${SP_CASES:-split,split+nowarm,split,split+nowarm}" > "$OUT/sp.txt" 2>&1; grep -E "fetch_us|Error" "$OUT/sp.txt" ;;
  thirtythird-d)  # the fetch's floor (bench/fetch_probe.py), then the in-place share on the layer's own stream
                  # (default) against the second stream (sharelast), 25% skewed hotpath alternated (CASES), then the
                  # serial-phase profile of both (SP_CASES)
    timeout 60 python3 bench/fetch_probe.py --out "$OUT/fp" 2>&1 | tail -2
    HP_TIMEOUT=${HP_TIMEOUT:-300} loc1_hotpath "${CASES:-split,split+sharelast,split,split+sharelast,split,split+sharelast}"
    timeout 150 python3 bench/serial_phase.py --model /dev/shm/loc1 --out "$OUT/sp" \
      --cases "${SP_CASES:-split,split+sharelast}" > "$OUT/sp.txt" 2>&1; grep -E "Error" "$OUT/sp.txt" ;;
  thirtythird-e)  # every GPU test, then the two-kernel fetch and the share on the layer's own stream (split, the
                  # defaults) against either or both undone (fetch1, sharelast), 25% skewed hotpath (CASES)
                  # (fetch1 needs 261089a: the one-kernel fetch was removed in the thirty-fourth session)
    gpu_tests 4
    HP_TIMEOUT=${HP_TIMEOUT:-300} loc1_hotpath "${CASES:-split,split+sharelast+fetch1,split+fetch1,split+sharelast,split,split+sharelast+fetch1}" ;;
  thirtythird-f)  # the mailbox's GPU tests, then the suite's skewed 25% case with this session's two changes (new) and
                  # without (old: STRATA_MAILBOX_SHARE_FIRST=0 STRATA_MAILBOX_FETCH=one), alternated (REPS pairs)
                  # (needs 261089a: the one-kernel fetch was removed in the thirty-fourth session)
    timeout 120 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py 2>&1 | tail -2
    for r in $(seq "${REPS:-2}"); do
      b25_suite "b25-new-$r"
      STRATA_MAILBOX_SHARE_FIRST=0 STRATA_MAILBOX_FETCH=one b25_suite "b25-old-$r"
    done ;;
  thirtyfourth)  # every GPU test, the serial phase at this code (the pairs' outputs zeroed in the pack kernel, no memset
                 # node between the router and the post), then the suite's skewed 25% case here (new) against the tree
                 # at $OLD_TREE (old: the same tree with an earlier strata/), alternated (REPS pairs)
    gpu_tests 4
    loc1_serial_phase 150 "Error"
    for r in $(seq "${REPS:-1}"); do
      b25_suite "b25-new-$r"
      [ -z "${OLD_TREE:-}" ] || (cd "$OLD_TREE" && PYTHONPATH=/tmp/site:$OLD_TREE b25_suite "b25-old-$r")
    done ;;
  thirtyfourth-b)  # the quick suite on a fresh box, then its 40% skewed case here (new) against $OLD_TREE (old),
                   # alternated (REPS pairs): that case ran at 270 tok/s in call 2's suite, 412 in run AE
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    timeout 300 python3 -m bench run --suite quick --deadline "${DEADLINE:-280}" --out "$OUT/suite" 2>&1 | grep -E "^[a-z-]+/"
    for r in $(seq "${REPS:-1}"); do
      for tree in "$PWD" "${OLD_TREE:-}"; do
        [ -n "$tree" ] || continue
        label=$([ "$tree" = "$PWD" ] && echo new || echo old)  # (call 3 named both "new": set inside the cd)
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 80 python3 -m bench run --suite quick --deadline 70 \
          --cases 'split/b40/skewed/p128x1' --out "$OUT/b40-$label-$r" 2>&1 \
          | grep -E '^split/'; rm -f "$OUT"/b40-*/*.png "$OUT"/b40-*/*.md)
      done
    done ;;
  thirtyfourth-c)  # why the 40% skewed case slowed on this session's boxes (worker kernel ~25 GB/s, GPU share ~0.55-0.6):
                   # hotpath at a 40% budget, the adapted share (split) against a fixed 0.35 and warm-ahead off (CASES)
    HP_FRACTION=0.4 HP_TIMEOUT=${HP_TIMEOUT:-420} loc1_hotpath "${CASES:-split,split+share0.35,split+nowarm,split,split+share0.35,split+nowarm}" ;;
  thirtyfourth-d)  # the suite's 40% skewed case on another box, beside cpu-only (the worker's rate alone: a box check), then
                   # again with the in-place share on the second stream (STRATA_MAILBOX_SHARE_FIRST=0, as before 666107a)
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    timeout 200 python3 -m bench run --suite quick --deadline 190 --cases 'cpu-only/b0/skewed/p128x1' \
      'split/b40/skewed/p128x1' --out "$OUT/d1" 2>&1 | grep -E "^[a-z-]+/"
    STRATA_MAILBOX_SHARE_FIRST=0 timeout 90 python3 -m bench run --suite quick --deadline 80 \
      --cases 'split/b40/skewed/p128x1' --out "$OUT/d2" 2>&1 | grep -E "^[a-z-]+/"
    rm -f "$OUT"/d*/*.png "$OUT"/d*/*.md ;;
  thirtyfifth)  # the mailbox's GPU tests; the serial phase with the step's ends and the cold phases' spread (new); then
                # the suite's skewed 25% and 40% cases with the GPU share balanced on the GPU's waits (balance, the new
                # default) against the worker-rate rule (rate), alternated (REPS rounds); one summary file, share_ab.json
    [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -m gpu tests/test_cpu_mailbox.py tests/test_copy_ahead.py \
      tests/test_decode_path.py 2>&1 | tail -3
    loc1_serial_phase 120 "Error|answer_there|idle_positive"
    for r in $(seq "${REPS:-2}"); do
      for mode in ${MODES:-balance rate}; do
        for b in ${BUDGETS:-25 40}; do
          STRATA_MAILBOX_SHARE_ADAPT=$mode ab_case "$mode-b$b-$r" "split/b$b/skewed/p128x1"
        done
      done
    done
    ab_summary ;;
  thirtyfifth-b)  # the suite's skewed 25% case, the GPU share balanced (balance) against the rate rule (rate): on the
                  # bare box, then beside $HOGS numpy copy loops that take host RAM bandwidth and cores (a stand-in for
                  # the degraded boxes where the rate rule ran away to its cap), alternated REPS rounds each
    for hog in 0 "${HOGS:-3}"; do
      pids=""
      for _ in $(seq "$hog"); do
        python3 -c "import numpy as np
a = np.ones(1 << 28); b = np.empty_like(a)
while True: np.copyto(b, a)" & pids="$pids $!"
      done
      for r in $(seq "${REPS:-2}"); do
        for mode in ${MODES:-balance rate}; do
          STRATA_MAILBOX_SHARE_ADAPT=$mode ab_case "hog$hog-$mode-$r" "split/b25/skewed/p128x1"
        done
      done
      [ -z "$pids" ] || kill $pids
    done
    ab_summary ;;
  thirtyfifth-c)  # every GPU test at the session's code; the serial phase (the step's ends, now without the sampler's
                  # softmax); the suite's two skewed split cases and the ceiling (the step gap on the worker's clock)
    gpu_tests 4
    loc1_serial_phase 120 "Error|answer_there|idle_positive"
    timeout 220 python3 -m bench run --suite quick --deadline 200 --cases 'split/b25/skewed/p128x1' \
      'split/b40/skewed/p128x1' 'ceiling/all/skewed/p128x1' --out "$OUT/ab/final" 2>&1 | grep -E "^[a-z-]+/"
    ab_summary ;;
  thirtyfifth-d)  # do promotions lengthen the step's end? The suite's 40% skewed case (the most promotions a token) with
                  # promotions on (the default) and off (policy.promote = false), alternated (REPS rounds): the
                  # worker's step gap (a step's last answer to the next step's first post) beside the promotions a token
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    promote_ab "${BUDGET:-40}"
    ab_summary ;;
  thirtyfifth-e)  # is the promotions' step-end cost the host's (the GIL: books, transfer workers and the decoding thread
                  # on one interpreter)? The 40% skewed case with Python's GIL switch interval at its default (5 ms)
                  # and at $SWITCH_S (default 0.0005), alternated (REPS rounds): the step gap beside promotions a token
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    for r in $(seq "${REPS:-1}"); do
      for sw in default "${SWITCH_S:-0.0005}"; do
        timeout 100 python3 -c "import runpy, sys
if sys.argv[1] != 'default': sys.setswitchinterval(float(sys.argv[1]))
sys.argv = ['bench'] + sys.argv[2:]
runpy.run_module('bench', run_name='__main__')" "$sw" run --suite full --layers 12 --tokens 64 --deadline 90 \
          --cases "split/b${BUDGET:-40}/skewed/p128x1" --out "$OUT/ab/switch-$sw-$r" 2>&1 | grep -E '^split/' \
          | sed "s/^/switch $sw r$r: /"
      done
    done
    ab_summary ;;
  thirtysixth)  # every GPU test (the clear-count test among them); then what a promotion costs the step: the 40% skewed
                # case with promotions on and off alternated (REPS rounds), then the 25% one with them on; each prints the
                # transfer worker's host time a promotion and the GPU map clears that waited behind a copy in flight
    gpu_tests 5
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    promote_ab 40
    ab_case "promote-true-b25" "split/b25/skewed/p128x1"
    ab_summary ;;
  thirtysixth-b)  # the books inline on the decoding thread, promotions issued there (inline, the new default) against
                  # their own thread with promotions on transfer workers (thread): the 40% and 25% skewed cases, alternated
                  # (REPS rounds); every GPU test first unless SKIP_TESTS
    gpu_tests 5
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    for r in $(seq "${REPS:-1}"); do
      for b in 40 25; do
        for mode in inline thread; do
          STRATA_MAILBOX_BOOKS=$mode ab_case "books-$mode-b$b-$r" "split/b$b/skewed/p128x1"
        done
      done
    done
    ab_summary ;;
  thirtysixth-c)  # each promotion issued only while the step's GPU work runs: the suite's cases with the most promotions
                  # (no-prefetch and split at 40%, skewed) and the split 25% skewed case, inline; then the 25% case on its
                  # books' own thread (the rule before this session)
    rm -rf /dev/shm/b12* /dev/shm/b4* /dev/shm/loc1 /dev/shm/sc
    for c in no-prefetch/b25 split/b40 split/b25; do
      ab_case "inline-${c%%/*}-${c##*/}" "$c/skewed/p128x1"
    done
    STRATA_MAILBOX_BOOKS=thread ab_case "thread-split-b25" "split/b25/skewed/p128x1"
    ab_summary ;;
  twentysixth)  # programmatic dependent launch (strata.kernels.pdl): every GPU test, then the all-in-VRAM decode A/B,
                # alternated 3 x 2, 256 tokens a case, on the temporal-locality checkpoint (the suite's skewed one)
    python3 -c "import torch, triton; from strata.kernels import pdl; print('triton', triton.__version__, 'pdl in force:',
pdl.on(torch.zeros(1, device='cuda')))"
    timeout 300 python3 -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -4 "$OUT/gpu_tests.txt"
    python3 -m strata demo-model /dev/shm/loc1 --size bench --layers 12 --no-engram --route-skew 1.0 --route-locality 1 \
      > /dev/null 2>&1
    timeout 200 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hotpath-ceiling" --tokens 256 \
      --prefill 0 --cases "${2:-ceiling,ceiling+nopdl,ceiling+again,ceiling+nopdl+again,ceiling+again,ceiling+nopdl+again}" \
      2>&1 | grep -E "^\{'case'" | cut -c1-400 ;;
  twentysixth-b)  # the split A/B with and without PDL: skewed (temporal locality) 3 x 2, uniform 2 x 2
    make_loc1
    timeout 250 python3 bench/hotpath.py --model /dev/shm/loc1 --cache /dev/shm/sc --out "$OUT/hotpath-loc1" --tokens 128 \
      --prefill 0 --cases "${2:-split,split+nopdl,split+again,split+nopdl+again,split+again,split+nopdl+again}" \
      2>&1 | grep -E "^\{'case'" | cut -c1-700
    python3 -m strata demo-model /dev/shm/b12-uniform --size bench --layers 12 --no-engram --route-skew uniform \
      > /dev/null 2>&1
    timeout 200 python3 bench/hotpath.py --model /dev/shm/b12-uniform --cache /dev/shm/sc --out "$OUT/hotpath-uniform" \
      --tokens 64 --prefill 0 --cases "split,split+nopdl,split+again,split+nopdl+again" 2>&1 | grep -E "^\{'case'" | cut -c1-700 ;;
  sixteenth-b)  # after the sampler stopped syncing: its GPU tests, the syncs left in a step, the A/B on both routings
    timeout 120 python3 -m pytest -q -m gpu tests/test_sampler.py tests/test_overlap_decode.py 2>&1 | tail -2
    PREFILL=0 timeout 200 bash "$0" hotpath 1.0 "${2:-ceiling,ceiling+sync,split,split+sync,split+again}"
    for c in ceiling split; do
      cfg='{"runtime": {"experts": "memory"}}'
      [ $c = split ] && cfg='{"tiers": {"gpu": {"budget": "3623878656"}, "disk": {"path": "/dev/shm/sc", "scrub": false}}}'
      timeout 90 python3 bench/sync_probe.py --model /dev/shm/b12-1.0 --label "$c" --config "$cfg" --out "$OUT/sync" \
        2>&1 | grep '^{' | cut -c1-600
    done
    PREFILL=0 timeout 200 bash "$0" hotpath uniform "split,split+sync,split+again" ;;
  sixteenth-d)  # the 40%-budget skewed hit rate (0.840 in the suite, 0.900 before): overlap off, residents staged
    for v in default nooverlap nokeep; do
      set_='{}'; [ $v = nooverlap ] && set_='{"runtime": {"overlap_decode": false}}'
      [ $v = nokeep ] && set_='{"runtime": {"prefill_keeps_resident": false}}'
      timeout 160 python3 -m bench run --suite quick --cases 'split/b40/skewed/p128x1' --rates limits --deadline 140 \
        --out "$OUT/ab-$v" --set "$set_" 2>&1 | grep -E '^split|wrote' | sed "s/^/$v: /"
    done ;;
  *)  # not a past mode either
    # shellcheck disable=SC2034  # (read by h200_session.sh)
    past_mode_unknown=1; return 2 ;;
esac
}

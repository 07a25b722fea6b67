#!/usr/bin/env bash
# One device session in one command: build, smoke table, GPU tests, benchmark, memcheck.
# Logs go to $OUT (the device tool brings them back); each verdict is printed as it comes.
#   STAGES="build smoke pytest bench ktime anchor balance trace ncu sanitize racecheck harness timeline micro variants" SHAPES="..." ITERS=10 bash benchmarks/device_run.sh
# Stage `anchor` is the yardstick against FlashMLA (kernel time of both on identical inputs):
# it needs a copy of FlashMLA's measuring harness in .anchor/ (not part of the repository; git-ignored,
# carried to the device) and runs .anchor/ktime.sh on $KSHAPES (docs/performance.md).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jsm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"build smoke pytest bench sanitize"}
SHAPES=${SHAPES:-"v32_h128_s2_b128_k2048 v32_h128_s2_b1_k2048 v32_h64_s2_b128_k2048 v32_h16_s2_b128_k2048 model1_h128_s2_b128_k128_x1024"}
ITERS=${ITERS:-10}
PYTEST_ARGS=${PYTEST_ARGS:-"tests/test_gpu.py"}
summary=()
# Each verdict is printed as it comes (a call cut by its time limit keeps what finished) and,
# after a run that gets there, all together at the end.
note() { summary+=("$1"); echo "NOTE: $1"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
# Builds and installs the tree with CMAKE_ARGS $1, the log in $2 (CMAKE_CUDA_FLAGS is cached
# in the build tree, so every call states it).
build_tree() { CMAKE_ARGS="$1" python3 -m pip install --no-build-isolation --no-deps -e . >"$2" 2>&1; }
# Compiles a standalone CUDA program (the decode kernel without JAX) into $1 from the nvcc
# arguments after it (sources, -D flags).
build_tool() {
  local out=$1; shift
  nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
    -I"$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")" -Iffi -o "$out" "$@"
}
# FlashMLA's extension for the harness in .anchor/ (built once, then cached by build_fm.py).
build_flashmla() { python3 .anchor/build_fm.py >"$OUT/fm_build.log" 2>&1 || tail -20 "$OUT/fm_build.log"; }
# A variant is a patch stack, "a+b" (benchmarks/patches/a.patch, then b's) or "base" (none),
# with an optional "@N": built with -DJSM_TIMING_EXPERIMENT=N (decode_common.cuh; results
# wrong, so not smoked, only timed), e.g. "base@5"; "base@00" is the shipped build (N is 0)
# timed without a smoke, as any "@" name is. Its patch files, its timing experiment
# (0: none), its CMake arguments, and its name in file names (the transfer back refuses "+").
patches_of() { local s=${1%@*}; [[ $s == base ]] || tr '+' '\n' <<<"$s" | sed 's#.*#benchmarks/patches/&.patch#'; }
experiment_of() { [[ $1 == *@* ]] && echo "${1##*@}" || echo 0; }
cmake_args_of() {
  local m; m=$(experiment_of "$1")
  [[ $m == 0 ]] && echo "-DCMAKE_CUDA_FLAGS=" || echo "-DCMAKE_CUDA_FLAGS=-DJSM_TIMING_EXPERIMENT=$m"
}
file_name_of() { local f=${1//+/_and_}; echo "${f//@/_experiment}"; }
# Applies variant $1's patches to the tree, recording them (newest first) in `applied`; when
# one does not apply, reverts the others and fails. revert_variant undoes a successful one.
apply_variant() {
  applied=()
  for patch in $(patches_of "$1"); do git apply "$patch" && applied=("$patch" "${applied[@]}") || break; done
  [[ ${#applied[@]} == $(patches_of "$1" | wc -l) ]] && return 0
  revert_variant; return 1
}
revert_variant() { for patch in "${applied[@]}"; do git apply -R "$patch"; done; applied=(); }
# The smoke table's verdict in log $1, and whether a verdict line says every case passed.
smoke_line() { grep SMOKE "$1" || echo "SMOKE crashed"; }
smoke_passed() { [[ "$1" =~ SMOKE\ ([0-9]+)/([0-9]+) ]] && [[ ${BASH_REMATCH[1]} == ${BASH_REMATCH[2]} ]]; }
# Whether a variant is timed after its smoke verdict $1: every case passed, or, with
# VARIANT_TIME_FAILED=1, the table ran to its end with some cases wrong (a variant's speed
# is still worth a number when its results are not: one call instead of two while a new
# design is being debugged). A smoke that crashed or ran out of time is never timed.
smoke_lets_time() {
  smoke_passed "$1" || { [[ ${VARIANT_TIME_FAILED:-0} == 1 ]] && [[ "$1" =~ SMOKE\ [0-9]+/[0-9]+ ]]; }
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tail -1
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -1

if has build; then
  stamp build
  if build_tree "${CMAKE_ARGS:--DCMAKE_CUDA_FLAGS=}" "$OUT/build.log"; then
    note "build ok"
  else
    tail -40 "$OUT/build.log"; note "build FAILED"; exit 1
  fi
  python3 -c 'import jax_sparse_mla as j; print(j.build_info())'
  lib=$(ls build/*/libjsm_cuda.a | head -1)
  { cuobjdump -res-usage "$lib" 2>&1 | grep -E "Function|REG|SHARED" ; \
    echo "--- instruction mix of decode kernels"; \
    cuobjdump -sass "$lib" | awk '/Function :/{f=$3} /decode_kernel/{d=1} {print}' | \
      grep -oE "(HGMMA|LDGSTS|LDL|STL|BAR|MEMBAR|CCTL|ERRBAR|SYNCS|STAS|FENCE|HFMA2|PRMT)[.A-Z0-9_]*" | sort | uniq -c; } >"$OUT/sass.txt" 2>&1
  # The full SASS stays on the device (/tmp/sass_full.txt; at most 8 files come back from
  # $OUT, and the same SASS can be had here from a local nvcc -cubin build).
  cuobjdump -sass "$lib" >/tmp/sass_full.txt 2>&1
  grep -E "LDL|STL" "$OUT/sass.txt" && note "SASS has local memory traffic"
  # ptxas's C7511 / C7512 / C7514 (serialized wgmma) leave a wait after every HGMMA of the kernel.
  while read -r k; do note "wgmma SERIALIZED (a wait after every HGMMA): $k"; done < <(awk \
    '/Function :/{f=$3} /HGMMA/{h[f]++} /WARPGROUP.DEPBAR/{d[f]++} END{for (k in h) if (2 * d[k] >= h[k]) print k}' \
    /tmp/sass_full.txt)
fi

if has smoke; then
  stamp smoke
  timeout ${SMOKE_T:-150} python3 benchmarks/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log" | grep -vE "^\s*$" | tail -30
  note "$(smoke_line "$OUT/smoke.log")"
fi

if has pytest; then  # PYTEST_RUNS times in a row, each with fresh random seeds
  # `--count N` in PYTEST_ARGS needs pytest-repeat, which the machine lacks: a carried .whl/ has it.
  if [[ " $PYTEST_ARGS " == *" --count"* ]] && ls .whl/pytest_repeat-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps .whl/pytest_repeat-*.whl 2>&1 | tail -2
  fi
  for run in $(seq 1 ${PYTEST_RUNS:-1}); do
    stamp "pytest run $run"
    # No gemm autotuning: the tests' XLA reference compiles anew for every case (new shapes, a
    # random static sm_scale), and 8 workers autotuning its products on one GPU are the likely
    # reason a tiny case took 20-40 s (session 12; PYTEST_XLA_FLAGS= to compare).
    XLA_FLAGS="${PYTEST_XLA_FLAGS---xla_gpu_autotune_level=0}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
      timeout ${PYTEST_T:-270} python3 -m pytest $PYTEST_ARGS -q -n ${PYTEST_N:-8} \
      --timeout 240 -p no:cacheprovider -rfE --durations=12 2>&1 | tee "$OUT/pytest_$run.log" | tail -8
    # A failure's seed and assertion on stdout: the log itself may not come back (the device
    # returns a limited number of files), and a fresh seed is only known from it.
    grep -E "^(E  |_{3,} test|seed=)" "$OUT/pytest_$run.log" | head -${PYTEST_FAIL_LINES:-40}
    # No summary line (a -q in PYTEST_ARGS makes -qq, which drops it; or a crash): say so.
    summary=$(grep -E '(passed|failed|error)' "$OUT/pytest_$run.log" | tail -1)
    note "pytest run $run: ${summary:-NO SUMMARY LINE: $(tail -2 "$OUT/pytest_$run.log" | tr '\n' ' ')}"
  done
fi

if has bench; then
  stamp bench
  timeout ${BENCH_T:-150} python3 benchmarks/bench_decode.py --shapes $SHAPES --iters "$ITERS" $BENCH_ARGS --json "$OUT/bench.json" \
    2>&1 | tee "$OUT/bench.log" | grep -E "^\|"
  note "bench: $(grep -c '^| ' "$OUT/bench.log") table lines"
fi

if has ktime; then  # device time of each kernel of a few steady-state calls (one counter: no replay)
  stamp ktime
  timeout ${KTIME_T:-120} ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    -k regex:"decode_kernel|combine_kernel|plan_kernel" --launch-skip 6 --launch-count 8 \
    python3 benchmarks/bench_decode.py --shapes ${DIAG_SHAPE:-v32_h128_s2_b128_k2048} --no-xla --no-reference \
    --iters 3 >"$OUT/ktime.log" 2>&1
  grep -E "^  [a-z].*\(|gpu__time_duration" "$OUT/ktime.log" | paste - - | sed -E 's/ +/ /g' | cut -c1-160
  note "ktime: $(grep -c gpu__time_duration "$OUT/ktime.log") kernels timed"
fi

if has anchor; then  # ours vs FlashMLA, kernel time per call from ncu, same inputs
  stamp anchor
  if [[ -f .anchor/ktime.sh ]]; then
    build_flashmla
    OUT="$OUT" KSHAPES="${KSHAPES:-v32_h128_s2_b128_k2048}" bash .anchor/ktime.sh 2>&1 | grep -E "KTIME|median"
    note "$(grep KTIME "$OUT/ktime.txt" 2>/dev/null)"
    # A shape that came back without times: the end of its ncu log, printed and kept in $OUT
    # (a caller's output filter may drop the print; the full logs stay on the device).
    for sh in $(grep -oE 'KTIME [a-z0-9_]+ incomplete' "$OUT/ktime.txt" | cut -d' ' -f2); do
      echo "--- $sh:"; tail -40 "${KTIME_LOGS:-/tmp/ktime_logs}/ncu_$sh.log" | tee "$OUT/ktime_incomplete_$sh.log"
    done
  else
    note "anchor: no .anchor/ (copy FlashMLA's harness there and carry it)"
  fi
fi

if has balance; then  # how evenly the CTAs end, ours and FlashMLA's (ncu, same inputs): benchmarks/sm_balance.py
  stamp balance
  if [[ -f .anchor/side_by_side.py ]]; then
    build_flashmla
    for s in ${KSHAPES:-v32_h128_s2_b64_k2048}; do
      # More than one counter may make ncu replay each launch (memory saved and restored):
      # BALANCE_METRICS=sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_active.min keeps
      # to the SMs' own counters if the default is too slow.
      timeout ${BALANCE_T:-200} ncu --clock-control none --cache-control none \
        --metrics ${BALANCE_METRICS:-gpu__time_duration.sum,gpc__cycles_elapsed.max,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_active.min} \
        -k regex:"decode_kernel|sparse|mla" python3 .anchor/side_by_side.py --iters 3 --shapes "$s" \
        >"$OUT/balance_$s.log" 2>&1
      [[ $? == 124 ]] && note "balance $s: ncu cut at BALANCE_T=${BALANCE_T:-200} s (session 42: b128 needs more than 120)"
      python3 benchmarks/sm_balance.py "$OUT/balance_$s.log" "$s" | tee -a "$OUT/balance.txt"
    done
    note "balance: $(grep -c 'end/mean' "$OUT/balance.txt") kernels measured"
  else
    note "balance: no .anchor/ (copy FlashMLA's harness there and carry it)"
  fi
fi

if has trace; then  # bench wall time vs kernel time: one repetition under jax.profiler (CUPTI)
  stamp trace
  timeout ${TRACE_T:-150} python3 benchmarks/bench_decode.py --shapes ${DIAG_SHAPE:-v32_h128_s2_b128_k2048} \
    --no-xla --no-reference --iters 5 --trace /tmp/jsm_trace 2>&1 | tee "$OUT/trace.log" | grep -A8 "trace:"
  note "trace: $(grep -c 'trace:' "$OUT/trace.log") summaries"
fi

if has ncu; then  # hardware counters and per-instruction counts/stalls of one decode launch
  stamp ncu
  # (--set full crashes the JAX process at start-up; these sections work)
  # NCU_SKIP: decode launches to skip first (the first is cold: b = 1 h128 took 19.0 us there
  # against 15.4 in steady state); the bench makes 8+ launches per iteration.
  # The sections and the pages that come back, the same for FlashMLA's kernel (NCU_FM below).
  ncu_one=(ncu --clock-control none --launch-skip ${NCU_SKIP:-0} -c 1 --import-source yes
    --section SpeedOfLight --section WarpStateStats --section InstructionStats --section LaunchStats
    --section Occupancy --section SchedulerStats --section ComputeWorkloadAnalysis
    --section MemoryWorkloadAnalysis --section SourceCounters -f)
  # The report itself stays on the device (no ncu here to open it); its pages come back.
  ncu_pages() {  # report, file prefix in $OUT
    ncu -i "$1" --page details >"$OUT/$2_details.txt" 2>&1
    ncu -i "$1" --page source --print-source sass --csv >"$OUT/$2_source.csv" 2>&1
    # Per-pipe instruction rates (ComputeWorkloadAnalysis collects them): whether the
    # producers' conversions and the softmax's MUFU.EX2 share a saturated pipe (xu).
    ncu -i "$1" --page raw 2>&1 | grep -E "sm__(inst_executed_pipe|pipe)_[a-z_0-9]+" | sed -E 's/ +/ /g' >"$OUT/$2_pipes.txt"
  }
  timeout ${NCU_T:-240} "${ncu_one[@]}" -k regex:decode_kernel -o /tmp/prof \
    python3 benchmarks/bench_decode.py --shapes ${DIAG_SHAPE:-v32_h128_s2_b128_k2048} --no-xla --no-reference \
    --iters $(( NCU_SKIP > 0 ? 3 : 1 )) >"$OUT/ncu.log" 2>&1
  ncu_pages /tmp/prof.ncu-rep ncu
  note "ncu: $(wc -l <"$OUT/ncu_details.txt") detail lines, $(wc -l <"$OUT/ncu_source.csv") source lines"
  grep -E "pct_of_peak_sustained_active" "$OUT/ncu_pipes.txt" | head -${NCU_PIPE_LINES:-30}
  # Which unit of L1/TEX and of the whole memory system is the busiest, and the L1 tables
  # (wavefronts by kind): a second launch, so that a metric the tool rejects costs only this
  # (NCU_BREAKDOWN=0 skips it).
  [[ ${NCU_BREAKDOWN:-1} == 1 ]] && timeout ${NCU_T:-240} ncu --clock-control none -k regex:decode_kernel -c 1 \
    --metrics breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed,breakdown:gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed \
    --section MemoryWorkloadAnalysis_Tables \
    python3 benchmarks/bench_decode.py --shapes ${DIAG_SHAPE:-v32_h128_s2_b128_k2048} --no-xla --no-reference \
    --iters 1 >"$OUT/ncu_breakdown.txt" 2>&1
  [[ ${NCU_BREAKDOWN:-1} == 1 ]] && note "ncu breakdown: $(grep -c '%' "$OUT/ncu_breakdown.txt") lines with %"
  if [[ ${NCU_FM:-0} == 1 && -f .anchor/side_by_side.py ]]; then
    # FlashMLA's decode kernel on the same inputs, same sections (its launches: no JAX warm-up,
    # so the same skip is a steady-state launch too). Two more files: keep STAGES to "build ncu".
    # (its log comes back: session 37's FlashMLA report was missing and nothing said why)
    build_flashmla
    timeout ${NCU_T:-240} "${ncu_one[@]}" -k regex:flash_fwd_splitkv -o /tmp/prof_fm \
      python3 .anchor/side_by_side.py --shapes ${DIAG_SHAPE:-v32_h128_s2_b128_k2048} >"$OUT/ncu_fm.log" 2>&1
    ncu_pages /tmp/prof_fm.ncu-rep ncu_fm
    note "ncu FlashMLA: $(wc -l <"$OUT/ncu_fm_details.txt") detail lines"
  fi
fi

if has sanitize; then
  # compute-sanitizer (2025.3) sometimes segfaults in its own code on this JAX process (NOTES,
  # session 33): SAN_TRIES runs at most, until one ends with an error summary; each prints its rc.
  # SAN_OPTS: extra sanitizer options.
  for try in $(seq ${SAN_TRIES:-1}); do
    stamp "sanitize, try $try"
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -s KILL ${SAN_T:-150} \
      compute-sanitizer --tool memcheck --print-limit 20 ${SAN_OPTS:-} python3 benchmarks/gpu_smoke.py --sanitize \
      >"$OUT/sanitize_$try.log" 2>&1
    rc=$?
    tail -8 "$OUT/sanitize_$try.log"
    note "memcheck try $try (rc $rc): $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_$try.log" | tail -1) / $(grep SMOKE "$OUT/sanitize_$try.log")"
    grep -q 'ERROR SUMMARY' "$OUT/sanitize_$try.log" && break
  done
fi

if has racecheck; then  # shared-memory races and barrier misuse, in the JAX process (SAN_TOOLS: a subset)
  for tool in ${SAN_TOOLS:-racecheck synccheck}; do
    stamp "$tool"
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout ${SAN_T:-150} \
      compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/gpu_smoke.py --sanitize \
      >"$OUT/$tool.log" 2>&1
    note "$tool (rc $?): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
  done
fi

if has harness; then  # the sanitizers on the decode kernel and the combine (sanitizer_repro/decode_harness.cu: no JAX)
  stamp harness
  # First the minimal hand-off kernels (sanitizer_repro/): a racecheck report there is about the
  # pattern (named barriers: the decode kernel's WG0 -> WG1 hand-off of P and alpha; mbarriers:
  # the producers' valid words; cp.async landing on an mbarrier: the few-heads kernel's
  # unaligned rows and MODEL1 scale bytes), not about the decode kernel.
  for repro in named_barrier_handoff mbarrier_handoff cp_async_handoff; do
    nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/$repro benchmarks/sanitizer_repro/$repro.cu || continue
    for tool in racecheck synccheck; do
      compute-sanitizer --tool $tool /tmp/$repro >"$OUT/${repro}_$tool.log" 2>&1
      note "$repro $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|handoff' "$OUT/${repro}_$tool.log" | tr '\n' ' ')"
    done
  done
  if build_tool /tmp/decode_harness benchmarks/sanitizer_repro/decode_harness.cu ffi/cuda/decode_launch.cu ffi/cuda/combine.cu \
      >"$OUT/harness_build.log" 2>&1; then
    for tool in memcheck racecheck synccheck; do
      timeout ${HARNESS_T:-120} compute-sanitizer --tool $tool --print-limit ${HARNESS_PRINT_LIMIT:-200} /tmp/decode_harness \
        >"$OUT/harness_$tool.log" 2>&1
      note "harness $tool (rc $?): $(grep -E 'HARNESS|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/harness_$tool.log" | tr '\n' ' ')"
    done
    # Every racecheck report as its pair of sites (kernel + offset), counted: each pair should
    # be a known hand-off (NOTES.md names them by offset, from a local build's SASS).
    sed -E 's/^========= +//' "$OUT/harness_racecheck.log" | grep -A1 '^Error: Race reported' | \
      grep -oE '(Read|Write) access at .*\+0x[0-9a-f]+' | sed -E 's/access at void jsm::cuda::([a-z_]+)<\(jsm::KVFormat\)([0-9]), \(int\)([0-9]+), \(bool\)([0-9])>\(jsm::cuda::Params\)/\1<\2,\3,\4>/' | \
      paste - - | sort | uniq -c | sed 's/^/RACE PAIR /'
  else
    tail -20 "$OUT/harness_build.log"; note "harness: build FAILED"
  fi
fi

if has timeline; then  # CTA by CTA: when the decode kernel's CTAs start, end, and how long each phase takes (128 and 16 heads)
  # TIMELINE_MODES: the timing experiments to record (0 = the kernel as shipped; 1-4 as in
  # decode_common.cuh: with a role's work taken out, which spans of the others shrink).
  # TIMELINE_RECORDED=N (default 1): N launches recorded, and whether a CTA's speed stays with
  # its SM across them (and from its first piece to the rest within one).
  # TIMELINE_VARIANTS: patch stacks as in stage variants ("base a a+b"), each applied to the
  # tree for its build of the tool and reverted: ~40 s a variant, where timing one with ncu
  # costs ~80 (the timeline's launch time and phases are the b = 1 measure).
  for v in ${TIMELINE_VARIANTS:-base}; do
    if [[ $v == *@* ]]; then
      note "timeline $v: not run (its timing experiments are TIMELINE_MODES)"
    elif ! apply_variant "$v"; then
      note "timeline $v: does not apply"
    else
      # Every mode's build at once (one build's wall time for all of them), then each run alone.
      stamp "timeline $v: building modes ${TIMELINE_MODES:-0}"
      for mode in ${TIMELINE_MODES:-0}; do
        ( build_tool /tmp/cta_timeline_$mode -DJSM_CTA_TIMELINE -DJSM_TIMING_EXPERIMENT=$mode \
            benchmarks/micro/cta_timeline.cu ffi/cuda/decode_launch.cu >"$OUT/timeline_build_$mode.log" 2>&1
          echo $? >/tmp/cta_timeline_$mode.rc ) &
      done
      wait
      for mode in ${TIMELINE_MODES:-0}; do
        stamp "timeline $v, mode $mode"
        if [[ $(cat /tmp/cta_timeline_$mode.rc 2>/dev/null) == 0 ]]; then
          for h in ${TIMELINE_HEADS:-128 16}; do
            for b in ${TIMELINE_BATCHES:-1 128}; do
              echo "=== timeline $v, timing experiment $mode:"
              timeout 60 /tmp/cta_timeline_$mode "$b" "$h" 50 ${TIMELINE_RECORDED:-1} 2>&1
            done | tee -a "$OUT/timeline.txt"
          done
        else
          tail -20 "$OUT/timeline_build_$mode.log"; note "timeline $v, mode $mode: build FAILED"
        fi
      done
      revert_variant
    fi
  done
  note "timeline: $(grep -c 'CTAs worked' "$OUT/timeline.txt") batches recorded"
fi

if has micro; then  # microbenchmarks (benchmarks/micro/NAME.cu, no JAX): MICRO="tile_exchange wgmma_chains"
  for m in ${MICRO:-tile_exchange}; do
    stamp "micro $m"
    if build_tool /tmp/$m benchmarks/micro/$m.cu >"$OUT/micro_$m.log" 2>&1; then
      result=$(timeout ${MICRO_T:-120} /tmp/$m 2>&1); rc=$?
      echo "$result" | tee -a "$OUT/micro.txt"
      lines=$(grep -cE '^[A-Z]+ ' <<<"$result")
      if [[ $rc == 0 ]]; then note "micro $m: $lines result lines"; else note "micro $m FAILED (rc $rc) after $lines result lines: $(tail -1 <<<"$result")"; fi
    else
      tail -20 "$OUT/micro_$m.log"; note "micro $m: build FAILED"
    fi
  done
fi

if has variants; then  # kernel variants side by side: each of $VARIANTS (benchmarks/patches/NAME.patch,
  # or "base" for the tree as it is) applied, built, smoked and timed against FlashMLA on $KSHAPES
  # (VARIANT_TIMER=ours: our kernels alone, faster), then reverted. Runs last: the build left
  # behind is the last variant's.
  # VARIANT_PREBUILD=1: every variant is built first, all at once, each in a patched copy of the
  # tree installed into its own directory (/tmp/variants/NAME/site), and smoked and timed from
  # there (benchmarks/variant_python.py); the tree itself is not touched. One build's time for
  # all of them instead of one each (~50 s a variant).
  [[ -f .anchor/ktime.sh && ${VARIANT_TIMER:-ktime} != ours ]] && build_flashmla
  prebuilt() { [[ ${VARIANT_PREBUILD:-0} == 1 ]]; }
  if prebuilt && [[ ${VARIANT_TIMER:-ktime} != ours ]]; then
    # (ktime.sh times the library installed for the process: the tree's build)
    note "VARIANT_PREBUILD times with VARIANT_TIMER=ours only; building the variants in the tree"
    VARIANT_PREBUILD=0
  fi
  if prebuilt; then
    stamp "variants: building ${VARIANTS:-base}"
    rm -rf /tmp/variants  # (a warm machine keeps an earlier call's: only this call's count below)
    # Each name once: a name listed twice (a bracketing "base ... base") is timed twice from
    # one build (two builds into one directory at once corrupt it).
    for v in $(tr ' ' '\n' <<<"${VARIANTS:-base}" | awk 'NF && !seen[$0]++'); do
      vf=$(file_name_of "$v"); dir=/tmp/variants/$vf
      mkdir -p "$dir/src"
      tar c --exclude=./build --exclude=./.anchor --exclude=./.git --exclude=./.whl . | tar x -C "$dir/src"
      ( cd "$dir/src" && for patch in $(patches_of "$v"); do git apply "$patch" || exit 1; done &&
        CMAKE_ARGS="$(cmake_args_of "$v")" python3 -m pip install --no-build-isolation --no-deps --target "$dir/site" .
        echo $? >"$dir/rc"
      ) >"$OUT/build_$vf.log" 2>&1 &
    done
    wait
    if ! cat /tmp/variants/*/rc 2>/dev/null | grep -qx 0; then
      note "VARIANT_PREBUILD: no variant built (build_*.log); building them in the tree, one by one"
      VARIANT_PREBUILD=0
    fi
  fi
  for v in ${VARIANTS:-base}; do
    stamp "variant $v"
    vf=$(file_name_of "$v")
    applied=()
    if prebuilt; then
      # (no rc file: a patch did not apply; rc: pip's exit status)
      [[ -f /tmp/variants/$vf/rc ]] || { note "$v: does not apply"; continue; }
      [[ $(<"/tmp/variants/$vf/rc") == 0 ]]; built=$?
      py=(python3 benchmarks/variant_python.py "/tmp/variants/$vf/site")
    else
      py=(python3)
      apply_variant "$v" || { note "$v: does not apply"; continue; }
      # Rebuild what this variant and the last one (reverted) changed: a patch of .cu files only
      # (the combine's) recompiles those alone; one that touches a header, everything (the
      # header dependencies of the CUDA sources are not trusted to be tracked).
      changed=$(for patch in $(patches_of "$v") $last_patches; do git apply --numstat "$patch" | cut -f3; done)
      if [[ -z $changed ]]; then :; elif grep -qv '\.cu$' <<<"$changed"; then touch ffi/cuda/*; else touch $changed; fi
      last_patches=$(patches_of "$v")
      build_tree "$(cmake_args_of "$v")" "$OUT/build_$vf.log"; built=$?
    fi
    if [[ $built == 0 ]]; then
      # timed: whether to time it; wrong: what its tag says when its results are wrong.
      if [[ $(experiment_of "$v") == 0 ]]; then
        timeout ${SMOKE_T:-150} "${py[@]}" benchmarks/gpu_smoke.py >"$OUT/smoke_$vf.log" 2>&1
        line=$(smoke_line "$OUT/smoke_$vf.log")
        note "$v: $line"
        smoke_lets_time "$line" && timed=1 || timed=0
        smoke_passed "$line" && wrong="" || wrong=" (smoke FAILED: its results are wrong)"
      else  # (wrong by design, not smoked: a hang would still end at ncu's timeout)
        timed=1; wrong=""
      fi
      if [[ $timed == 1 && ${VARIANT_TIMER:-ktime} == ours && -f .anchor/side_by_side.py ]]; then
        # Our kernels alone under ncu (FlashMLA's time does not change from variant to variant:
        # take it once, from a `base` variant or the anchor stage, and save its launches here).
        # The logs stay on the device (only 8 files come back from $OUT); a failed one is tailed.
        logs=/tmp/variant_logs/$vf; mkdir -p "$logs"
        # VARIANT_ENVS: environment settings to time each shape under ("A=1,B=2" sets two;
        # "-" none), e.g. the knobs of sensitivity.patch.
        for e in ${VARIANT_ENVS:--}; do
          tag=$v; envs=(); [[ $e == - ]] || { tag="$v[$e]"; envs=(${e//,/ }); }
          tag="$tag$wrong"
          for sh in ${KSHAPES:-v32_h16_s2_b128_k2048}; do
            # ktime.sh's own timing of our kernels (side_by_side.time_ours), without FlashMLA.
            # A second try where the first came back without times (seen once, session 27:
            # the first shape of a call), its log's end shown.
            log="$logs/ncu_${sh}_${e//[^A-Za-z0-9]/_}.log"
            for attempt in 1 2; do
              timeout ${KTIME_T:-150} env "${envs[@]}" ncu --clock-control none --cache-control none \
                --metrics gpu__time_duration.sum -k regex:"decode_kernel|combine_kernel" \
                "${py[@]}" -c "import sys; sys.path.insert(0, '.anchor')
import side_by_side as s; from jax_sparse_mla import bench; shape = bench.shape_from_name('$sh')
s.time_ours(shape, bench.make_inputs(shape, max(bench._sets_for(shape), bench.CALLS_PER_TIMING)), 3)" \
                >"$log" 2>&1 || tail -5 "$log"
              times=$(python3 benchmarks/kernel_times.py "$log" "$sh")
              [[ $times == *incomplete* ]] || break
              echo "--- $sh, attempt $attempt:"; tail -15 "$log"
            done
            note "$tag: $times"
          done
        done
      elif [[ $timed == 1 && -z $wrong && -f .anchor/ktime.sh ]]; then
        OUT="$OUT/$vf" KSHAPES="${KSHAPES:-v32_h16_s2_b128_k2048}" bash .anchor/ktime.sh >/dev/null 2>&1
        while read -r k; do note "$v: $k"; done < <(grep KTIME "$OUT/$vf/ktime.txt" 2>/dev/null)
      fi
    else
      note "$v: build FAILED (build_$vf.log)"
    fi
    revert_variant
  done
fi

stamp done
printf '%s\n' "${summary[@]}"

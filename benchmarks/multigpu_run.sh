#!/usr/bin/env bash
# The multi-GPU checks on one n-GPU host in one device call (issue #14: nvidia-h200-x8; also
# -x4, -x2): build, `pytest -m multigpu` (TP n, DP n and DP 2 x TP n/2 through jit and shard_map,
# each equal to one GPU, no collective; the demo's layouts), then the demo of a 128-head model
# with TP n and with DP 2 x TP n/2, each beside one GPU at the same global batch
# (--vs-one-device). Logs to $OUT, the summary (machine, commit, results) printed last.
#   STAGES="build tests demo" N_GPUS=8 DEMO_ARGS="--heads 128 ..." bash benchmarks/multigpu_run.sh
# Without GPUs (N_GPUS=8 STAGES="tests demo" and a small DEMO_ARGS) the demo runs on 8 CPU
# devices and the multigpu tests skip: a dry run of the script.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jsm_out}
mkdir -p "$OUT"
# NVLink multicast stays off (the device notes: it can take a shared host's GPUs out of service).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COLUMNS=${COLUMNS:-150}  # the demo's tables unwrapped in the logs
PYTHON=${PYTHON:-python3}
STAGES=${STAGES:-"build tests demo"}
N_GPUS=${N_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
# The same global batch in every layout; top-k 512 filled by the prompt.
DEMO_ARGS=${DEMO_ARGS:-"--heads 128 --batch 64 --topk 512 --context 512 --steps 64"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
t0=$(date +%s)
summary="$OUT/summary.log"
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$summary"; }
note() { echo "$*" | tee -a "$summary"; }

{ date -u +"%Y-%m-%d %H:%M UTC"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  echo "GPUs: $N_GPUS; demo: $DEMO_ARGS"; } | tee "$summary"
if (( N_GPUS < 2 )); then
  note "N_GPUS=$N_GPUS: needs a host of 2 or more GPUs (or N_GPUS=8 for a CPU dry run)"; exit 1
fi

if has build; then
  stamp build
  if ! "$PYTHON" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"; note "build FAILED (build.log)"; exit 1
  fi
  "$PYTHON" -c 'import jax, jax_sparse_mla as j; print("jax", jax.__version__, jax.devices(), j.build_info())' 2>&1 \
    | tee -a "$summary"
fi

if has tests; then
  stamp "pytest -m multigpu"
  timeout ${TESTS_T:-240} "$PYTHON" -m pytest -q -p no:xdist -p no:cacheprovider -rfEs -m multigpu \
    tests/test_sharding.py tests/test_demo.py 2>&1 | tee "$OUT/multigpu.log" | tail -15
  note "multigpu tests: $(grep -E '(passed|failed|error|skipped)' "$OUT/multigpu.log" | tail -1)"
fi

# One demo layout: its table (beside one GPU) into the summary, everything into $OUT/demo_NAME.log.
demo() {
  local name=$1; shift
  stamp "demo $name: $*"
  if timeout ${DEMO_T:-150} "$PYTHON" -m jax_sparse_mla demo --no-progress --vs-one-device $DEMO_ARGS "$@" \
      >"$OUT/demo_$name.log" 2>&1; then
    sed -n '/jax_sparse_mla demo/,$p' "$OUT/demo_$name.log" >>"$summary"
  else
    tail -20 "$OUT/demo_$name.log" >>"$summary"; note "demo $name FAILED (demo_$name.log)"
  fi
}

if has demo; then
  demo "tp$N_GPUS" --tp "$N_GPUS"
  if (( N_GPUS >= 4 && N_GPUS % 2 == 0 )); then
    demo "dp2_tp$(( N_GPUS / 2 ))" --dp 2 --tp $(( N_GPUS / 2 ))
  else
    note "demo DP 2 x TP n/2: skipped ($N_GPUS GPUs; needs an even number >= 4)"
  fi
fi

stamp done
echo "=================== summary"
cat "$summary"

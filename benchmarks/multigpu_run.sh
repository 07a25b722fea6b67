#!/usr/bin/env bash
# Issue #4's GPU checks in one device call (kind nvidia-h200-x2): build, the multi-GPU tests
# (TP=2, DP=2), and the demo on one GPU and with TP=2. Logs to $OUT, a summary last.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jsm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/summary.log"; }
nvidia-smi -L | tee "$OUT/summary.log"
stamp build
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c 'import jax, jax_sparse_mla as j; print(jax.devices(), j.build_info())' 2>&1 | tee -a "$OUT/summary.log"
stamp multigpu-tests
timeout 100 python3 -m pytest -q -p no:xdist -m multigpu tests/test_sharding.py tests/test_demo.py 2>&1 \
  | tee "$OUT/multigpu.log" | tail -3 | tee -a "$OUT/summary.log"
stamp demo-1gpu
timeout 60 python3 -m jax_sparse_mla demo --no-progress 2>&1 | tee "$OUT/demo1.log" | tail -14 >>"$OUT/summary.log"
stamp demo-tp2
timeout 60 python3 -m jax_sparse_mla demo --no-progress --tp 2 --heads 32 2>&1 | tee "$OUT/demo2.log" | tail -14 >>"$OUT/summary.log"
stamp done
cat "$OUT/summary.log"

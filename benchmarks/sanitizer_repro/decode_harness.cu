// The CUDA decode kernel and the combine after it, launched without JAX, for
// compute-sanitizer: random cache bytes (NaN codes included), garbage indices (negative, past
// the cache), random lengths, sinks, an extra cache, the few-heads kernels (16, 24, 32 heads),
// solo CTAs (16 under a batch-invariant plan, 32 with few blocks, 64) and paired CTAs (128),
// aligned and unaligned MODEL1 pages, the default plan, 7 parts, the batch-invariant plan and garbage
// plans. The combine runs its few-rows kernels (16 heads) and its row walk (128 heads: more
// than 2 x 8 x 132 rows), on the plans' pieces and on garbage ones. It checks nothing numeric
// (tests/test_gpu.py does): a run passes when every launch returns and the sanitizer reports
// nothing. Under the JAX process compute-sanitizer itself crashed (benchmarks/NOTES.md,
// session 5); here a launch is a few lines of host code. Run:
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") -Iffi \
//     -o /tmp/decode_harness benchmarks/sanitizer_repro/decode_harness.cu \
//        ffi/cuda/decode_launch.cu ffi/cuda/combine.cu
//   compute-sanitizer --tool memcheck /tmp/decode_harness   (and racecheck, synccheck)
#include <cuda_runtime.h>

#include <cstdio>

#include "../micro/host_problem.h"
#include "cuda/combine.h"
#include "cuda/decode_common.cuh"

namespace {

using host_problem::Case;
using jsm::KVFormat;

bool run(const Case& c) {
  const jsm::DecodeProblem dp = host_problem::make_problem(c, /*garbage=*/true);
  const auto e = jsm::cuda::launch_decode(dp, nullptr);
  jsm::CombineProblem cp{};
  cp.batch = dp.batch;
  cp.s_q = dp.s_q;
  cp.h_q = dp.h_q;
  cp.num_parts = dp.num_parts;
  cp.has_sink = dp.has_sink;
  cp.out_src = cp.out = dp.out;
  cp.lse_src = cp.lse = dp.lse;
  cp.out_accum = dp.out_accum;
  cp.lse_accum = dp.lse_accum;
  cp.num_splits = dp.num_splits;
  cp.attn_sink = dp.attn_sink;
  cp.sink_stride = dp.sink_stride;
  const auto ec = jsm::cuda::launch_combine(cp, nullptr);
  const cudaError_t sync = cudaDeviceSynchronize();
  const bool ok = !e.failure() && !ec.failure() && sync == cudaSuccess;
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", c.name);
  if (e.failure()) std::printf("     decode launch: %s\n", e.message().c_str());
  if (ec.failure()) std::printf("     combine launch: %s\n", ec.message().c_str());
  if (sync != cudaSuccess) std::printf("     sync: %s\n", cudaGetErrorString(sync));
  return ok;
}

}  // namespace

int main() {
  const Case cases[] = {
      {"V32 h16 few-heads kernel, default plan", KVFormat::kV32, 3, 2, 16, 200, 0, 64, 64, 6, 0, 0},
      {"V32 h16 few-heads kernel, garbage plan, extra cache", KVFormat::kV32, 5, 2, 16, 130, 40, 64, 5, 5, 9, 3},
      {"V32 h16 solo (batch-invariant plan)", KVFormat::kV32, 4, 1, 16, 2200, 0, 64, 64, 40, 0, 2},
      // (the 32-head few-heads kernel needs >= 4 blocks a worker: decode_launch.cu)
      {"V32 h32 few-heads kernel (32), 7 parts", KVFormat::kV32, 8, 2, 32, 300, 70, 64, 5, 5, 20, 1},
      {"V32 h24 few-heads kernel (32), garbage plan, extra cache", KVFormat::kV32, 12, 2, 24, 600, 40, 64, 5, 12, 9, 3},
      {"V32 h32 few-heads kernel (32), one-block requests, 7 parts", KVFormat::kV32, 48, 2, 32, 64, 0, 64, 64, 8, 0, 1},
      {"V32 h32 64-row kernel (a block a worker or less)", KVFormat::kV32, 3, 2, 32, 150, 70, 64, 5, 5, 20, 1},
      {"V32 h64 solo, 7 parts, extra cache", KVFormat::kV32, 3, 2, 64, 150, 70, 64, 5, 5, 20, 1},
      {"V32 h128 pairs, default plan, extra cache", KVFormat::kV32, 4, 2, 128, 300, 90, 64, 17, 8, 9, 0},
      {"V32 h128 pairs, batch-invariant plan", KVFormat::kV32, 4, 1, 128, 2200, 0, 64, 64, 40, 0, 2},
      {"V32 h128 pairs, garbage plan", KVFormat::kV32, 5, 2, 128, 130, 40, 64, 5, 5, 9, 3},
      {"MODEL1 h16 few-heads kernel, pages of 61, extra of 17", KVFormat::kModel1, 3, 2, 16, 100, 90, 61, 17, 6, 12, 0},
      {"MODEL1 h16 few-heads kernel, garbage plan", KVFormat::kModel1, 5, 2, 16, 130, 40, 61, 5, 5, 9, 3},
      {"MODEL1 h16 few-heads kernel, aligned pages, 7 parts", KVFormat::kModel1, 4, 2, 16, 300, 70, 64, 64, 8, 4, 1},
      {"MODEL1 h32 few-heads kernel (32), 7 parts", KVFormat::kModel1, 8, 2, 32, 300, 70, 64, 5, 5, 20, 1},
      {"MODEL1 h32 few-heads kernel (32), aligned pages, 7 parts", KVFormat::kModel1, 8, 2, 32, 300, 70, 64, 64, 8, 4, 1},
      {"MODEL1 h24 few-heads kernel (32), pages of 61, garbage plan", KVFormat::kModel1, 12, 2, 24, 600, 40, 61, 5, 12, 9, 3},
      {"MODEL1 h64 solo, 7 parts", KVFormat::kModel1, 3, 3, 64, 128, 0, 64, 64, 8, 0, 1},
      {"MODEL1 h128 pairs, default plan, extra cache", KVFormat::kModel1, 4, 2, 128, 300, 70, 64, 64, 8, 4, 0},
      {"MODEL1 h128 pairs, pages of 61, garbage plan", KVFormat::kModel1, 5, 2, 128, 130, 40, 61, 5, 5, 9, 3},
  };
  int failed = 0;
  for (const Case& c : cases) failed += !run(c);
  std::printf("HARNESS %d/%d launches ok\n", static_cast<int>(sizeof(cases) / sizeof(cases[0])) - failed,
              static_cast<int>(sizeof(cases) / sizeof(cases[0])));
  return failed ? 1 : 0;
}

// The CUDA decode kernel launched on its own, without JAX, for compute-sanitizer: random
// cache bytes (NaN codes included), garbage indices (negative, past the cache), random
// lengths, sinks, an extra cache, the few-heads kernel (16 heads), solo CTAs (16 under a
// batch-invariant plan, 32, 64 heads) and paired CTAs (128), aligned and
// unaligned MODEL1 pages, the default plan, 7 parts, the batch-invariant plan and garbage
// plans. It checks nothing numeric (tests/test_gpu.py does): a run passes when every launch
// returns and the sanitizer reports nothing. Under the JAX process compute-sanitizer itself
// crashed (benchmarks/NOTES.md, session 5); here a launch is a few lines of host code. Run:
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") -Iffi \
//     -o /tmp/decode_harness benchmarks/sanitizer_repro/decode_harness.cu ffi/cuda/decode_launch.cu
//   compute-sanitizer --tool memcheck /tmp/decode_harness   (and racecheck, synccheck)
#include <cuda_runtime.h>

#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/problem.h"
#include "common/split_plan.h"
#include "cuda/decode_common.cuh"

namespace {

using jsm::KVFormat;

std::mt19937 rng(1234);

int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// A device copy of `host`, freed at exit (the process ends after the cases).
template <typename T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  cudaMalloc(&d, host.size() * sizeof(T) + 16);
  cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
T* device_zeros(size_t n) {
  T* d = nullptr;
  cudaMalloc(&d, n * sizeof(T) + 16);
  cudaMemset(d, 0, n * sizeof(T) + 16);
  return d;
}

// Cache bytes: random codes and RoPE bits; V32 scales 1.0 (random floats would make no
// difference to the sanitizers, but keep the sums finite on most rows).
std::vector<uint8_t> cache_bytes(KVFormat f, int64_t tokens) {
  std::vector<uint8_t> b(tokens * jsm::bytes_per_token(f));
  for (auto& x : b) x = static_cast<uint8_t>(uniform(0, 255));
  if (f == KVFormat::kV32)
    for (int64_t t = 0; t < tokens; ++t)
      for (int k = 0; k < 4; ++k) {
        const float one = 1.f;
        std::memcpy(&b[t * jsm::V32Layout::kBytesPerToken + jsm::V32Layout::kScaleOffset + 4 * k], &one, 4);
      }
  return b;
}

// Indices in [-tokens, 2 tokens): about a third outside the cache.
std::vector<int32_t> garbage_indices(int64_t n, int64_t tokens) {
  std::vector<int32_t> v(n);
  for (auto& x : v) x = uniform(-static_cast<int>(tokens), 2 * static_cast<int>(tokens) - 1);
  return v;
}

struct Case {
  const char* name;
  KVFormat format;
  int batch, s_q, h_q, topk, extra_topk;
  int64_t page_size, extra_page_size;
  int num_pages, extra_num_pages;
  int plan;  // 0: default split plan, 1: 7 parts, 2: batch-invariant, 3: garbage
};

bool run(const Case& c) {
  const int d_qk = c.format == KVFormat::kV32 ? jsm::V32Layout::kDimQK : jsm::Model1Layout::kDimQK;
  const int64_t tokens = c.num_pages * c.page_size, extra_tokens = c.extra_num_pages * c.extra_page_size;
  const int b = c.batch;
  std::vector<int32_t> lens(b), extra_lens(b);
  for (int i = 0; i < b; ++i) {
    lens[i] = uniform(-3, c.topk + 5);
    extra_lens[i] = uniform(-3, c.extra_topk + 5);
  }
  auto blocks_of = [&](int i) {
    return jsm::main_blocks(jsm::clamp_length(lens[i], c.topk)) +
           jsm::extra_blocks(jsm::clamp_length(extra_lens[i], c.extra_topk));
  };
  int num_parts = c.plan == 1 ? 7 : 33;
  if (c.plan == 2) num_parts = static_cast<int>(std::max<int64_t>(num_parts, jsm::invariant_parts_needed(b, c.topk, c.extra_topk)));
  std::vector<int32_t> sched(num_parts * jsm::kSchedFields), splits(b + 1);
  jsm::build_plan(c.plan == 2, b, num_parts, blocks_of, sched.data(), splits.data());
  if (c.plan == 3) {
    for (auto& x : sched) x = uniform(-2, 2 * b + 40);
    for (auto& x : splits) x = uniform(-2, 2 * b + 9);
  }
  std::vector<uint16_t> q(static_cast<size_t>(b) * c.s_q * c.h_q * d_qk);
  for (auto& x : q) x = static_cast<uint16_t>(0x3c00 + uniform(-256, 256));  // bf16 around 0.0078
  std::vector<float> sink(c.h_q);
  for (auto& x : sink) x = static_cast<float>(uniform(-4, 4));

  jsm::DecodeProblem dp{};
  dp.format = c.format;
  dp.batch = b;
  dp.s_q = c.s_q;
  dp.h_q = c.h_q;
  dp.d_qk = d_qk;
  dp.topk = c.topk;
  dp.extra_topk = c.extra_topk;
  dp.num_parts = num_parts;
  dp.page_size = c.page_size;
  dp.extra_page_size = c.extra_page_size;
  dp.num_tokens = tokens;
  dp.extra_num_tokens = extra_tokens;
  dp.sm_scale = 0.05f;
  dp.has_sink = true;
  dp.batch_invariant = c.plan == 2;
  dp.q = to_device(q);
  dp.kv = to_device(cache_bytes(c.format, tokens));
  dp.indices = to_device(garbage_indices(static_cast<int64_t>(b) * c.s_q * c.topk, tokens));
  dp.topk_length = to_device(lens);
  const int64_t extra_n = std::max<int64_t>(static_cast<int64_t>(b) * c.s_q * c.extra_topk, 1);
  dp.extra_kv = to_device(cache_bytes(c.format, std::max<int64_t>(extra_tokens, 1)));
  dp.extra_indices = to_device(garbage_indices(extra_n, std::max<int64_t>(extra_tokens, 1)));
  dp.extra_topk_length = to_device(extra_lens);
  dp.attn_sink = to_device(sink);
  dp.sink_stride = 0;
  dp.sched = to_device(sched);
  dp.num_splits = to_device(splits);
  const size_t rows = static_cast<size_t>(c.s_q) * c.h_q;
  dp.out = device_zeros<uint16_t>(b * rows * jsm::kDimV);
  dp.lse = device_zeros<float>(b * rows);
  dp.out_accum = device_zeros<float>((b + num_parts) * rows * jsm::kDimV);
  dp.lse_accum = device_zeros<float>((b + num_parts) * rows);

  const auto e = jsm::cuda::launch_decode(dp, nullptr);
  const cudaError_t sync = cudaDeviceSynchronize();
  const bool ok = !e.failure() && sync == cudaSuccess;
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", c.name);
  if (e.failure()) std::printf("     launch: %s\n", e.message().c_str());
  if (sync != cudaSuccess) std::printf("     sync: %s\n", cudaGetErrorString(sync));
  return ok;
}

}  // namespace

int main() {
  const Case cases[] = {
      {"V32 h16 few-heads kernel, default plan", KVFormat::kV32, 3, 2, 16, 200, 0, 64, 64, 6, 0, 0},
      {"V32 h16 few-heads kernel, garbage plan, extra cache", KVFormat::kV32, 5, 2, 16, 130, 40, 64, 5, 5, 9, 3},
      {"V32 h16 solo (batch-invariant plan)", KVFormat::kV32, 4, 1, 16, 2200, 0, 64, 64, 40, 0, 2},
      {"V32 h32 solo, 7 parts", KVFormat::kV32, 3, 2, 32, 150, 70, 64, 5, 5, 20, 1},
      {"V32 h64 solo, 7 parts, extra cache", KVFormat::kV32, 3, 2, 64, 150, 70, 64, 5, 5, 20, 1},
      {"V32 h128 pairs, default plan, extra cache", KVFormat::kV32, 4, 2, 128, 300, 90, 64, 17, 8, 9, 0},
      {"V32 h128 pairs, batch-invariant plan", KVFormat::kV32, 4, 1, 128, 2200, 0, 64, 64, 40, 0, 2},
      {"V32 h128 pairs, garbage plan", KVFormat::kV32, 5, 2, 128, 130, 40, 64, 5, 5, 9, 3},
      {"MODEL1 h16 few-heads kernel, pages of 61, extra of 17", KVFormat::kModel1, 3, 2, 16, 100, 90, 61, 17, 6, 12, 0},
      {"MODEL1 h16 few-heads kernel, garbage plan", KVFormat::kModel1, 5, 2, 16, 130, 40, 61, 5, 5, 9, 3},
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

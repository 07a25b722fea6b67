// A decode problem built on the host and copied to the device, for the programs that launch
// the CUDA decode kernel without JAX (benchmarks/sanitizer_repro/decode_harness.cu: garbage
// inputs for the sanitizers; benchmarks/micro/cta_timeline.cu: realistic inputs for timing).
// Device memory is never freed: each program ends after its few problems.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/problem.h"
#include "common/split_plan.h"

namespace host_problem {

using jsm::KVFormat;

inline std::mt19937& rng() {
  static std::mt19937 r(1234);
  return r;
}

inline int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng()); }

// A device copy of `host`.
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

// Cache bytes: random codes and RoPE bits (`finite`: no e4m3 NaN codes 0x7f / 0xff); V32
// scales 1.0 (keeps the sums finite on most rows).
inline std::vector<uint8_t> cache_bytes(KVFormat f, int64_t tokens, bool finite) {
  std::vector<uint8_t> b(tokens * jsm::bytes_per_token(f));
  for (size_t i = 0; i < b.size(); i += 4) {  // four bytes a draw: a b = 128 cache is 2.7 GB
    const uint32_t word = rng()();
    for (size_t k = 0; k < 4 && i + k < b.size(); ++k) b[i + k] = static_cast<uint8_t>(word >> (8 * k));
  }
  if (finite)
    for (auto& x : b)
      if ((x & 0x7f) == 0x7f) x ^= 1;
  if (f == KVFormat::kV32)
    for (int64_t t = 0; t < tokens; ++t)
      for (int k = 0; k < 4; ++k) {
        const float one = 1.f;
        std::memcpy(&b[t * jsm::V32Layout::kBytesPerToken + jsm::V32Layout::kScaleOffset + 4 * k], &one, 4);
      }
  return b;
}

// `garbage`: indices in [-tokens, 2 tokens), about a third outside the cache; otherwise all
// in [0, tokens).
inline std::vector<int32_t> indices(int64_t n, int64_t tokens, bool garbage) {
  std::vector<int32_t> v(n);
  const int t = static_cast<int>(tokens);
  for (auto& x : v) x = garbage ? uniform(-t, 2 * t - 1) : uniform(0, t - 1);
  return v;
}

struct Case {
  const char* name;
  KVFormat format;
  int batch, s_q, h_q, topk, extra_topk;
  int64_t page_size, extra_page_size;
  int num_pages, extra_num_pages;
  int plan;  // 0: default split plan (33 parts), 1: 7 parts, 2: batch-invariant, 3: garbage
};

// `garbage`: random lengths (some out of [0, topk]) and garbage indices, as the sanitizers
// want; otherwise every list full and every index valid, as a served model's are.
inline jsm::DecodeProblem make_problem(const Case& c, bool garbage) {
  const int d_qk = c.format == KVFormat::kV32 ? jsm::V32Layout::kDimQK : jsm::Model1Layout::kDimQK;
  const int64_t tokens = c.num_pages * c.page_size, extra_tokens = c.extra_num_pages * c.extra_page_size;
  const int b = c.batch;
  std::vector<int32_t> lens(b, c.topk), extra_lens(b, c.extra_topk);
  if (garbage)
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
  dp.kv = to_device(cache_bytes(c.format, tokens, !garbage));
  dp.indices = to_device(indices(static_cast<int64_t>(b) * c.s_q * c.topk, tokens, garbage));
  dp.topk_length = to_device(lens);
  const int64_t extra_n = std::max<int64_t>(static_cast<int64_t>(b) * c.s_q * c.extra_topk, 1);
  dp.extra_kv = to_device(cache_bytes(c.format, std::max<int64_t>(extra_tokens, 1), !garbage));
  dp.extra_indices = to_device(indices(extra_n, std::max<int64_t>(extra_tokens, 1), garbage));
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
  return dp;
}

}  // namespace host_problem

// CPU handler of jsm_combine: merges the pieces of every split request (docs/schedule.md, Combine).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/problem.h"

namespace jsm {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();

// max that keeps NaN (std::fmax drops it): a NaN piece must not make a row look empty.
float max_keep_nan(float a, float b) { return (b > a || b != b) ? b : a; }

ffi::Error CombineCpu(ffi::AnyBuffer out_in, ffi::Buffer<ffi::F32> lse_in, ffi::Buffer<ffi::F32> out_accum,
                      ffi::Buffer<ffi::F32> lse_accum, ffi::Buffer<ffi::S32> num_splits,
                      ffi::Buffer<ffi::F32> attn_sink, bool has_sink, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  CombineProblem p;
  JSM_RETURN_IF_ERROR(make_combine_problem(out_in, lse_in, out_accum, lse_accum, num_splits, attn_sink, has_sink,
                                           out, lse, &p));
  const int64_t rows = static_cast<int64_t>(p.batch) * p.s_q * p.h_q;
  if (p.out_src != p.out) std::memcpy(p.out, p.out_src, rows * kDimV * sizeof(uint16_t));
  if (p.lse_src != p.lse) std::memcpy(p.lse, p.lse_src, rows * sizeof(float));

  const int64_t slots = static_cast<int64_t>(p.batch) + p.num_parts;
  std::vector<float> acc(kDimV);
  for (int r = 0; r < p.batch; ++r) {
    const int first = p.num_splits[r];
    const int pieces = p.num_splits[r + 1] - first;
    if (pieces <= 1) continue;  // written by the decode pass
    if (first < 0 || first + pieces > slots) return invalid("combine: num_splits points past the partial buffers");
    for (int s = 0; s < p.s_q; ++s) {
      for (int h = 0; h < p.h_q; ++h) {
        auto lse_at = [&](int k) { return p.lse_accum[((first + k) * int64_t{p.s_q} + s) * p.h_q + h]; };
        float mx = -kInf;
        for (int k = 0; k < pieces; ++k) mx = max_keep_nan(mx, lse_at(k));
        uint16_t* o = p.out + ((int64_t{r} * p.s_q + s) * p.h_q + h) * kDimV;
        float* l = p.lse + (int64_t{r} * p.h_q + h) * p.s_q + s;
        if (mx == -kInf) {  // every piece empty
          std::memset(o, 0, kDimV * sizeof(uint16_t));
          *l = kInf;
          continue;
        }
        float sum = 0.f;
        for (int k = 0; k < pieces; ++k) sum += std::exp2(lse_at(k) - mx);
        const float g = std::log2(sum) + mx;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int k = 0; k < pieces; ++k) {
          const float w = std::exp2(lse_at(k) - g);
          if (w == 0.f) continue;
          const float* part = p.out_accum + (((first + k) * int64_t{p.s_q} + s) * p.h_q + h) * kDimV;
          for (int d = 0; d < kDimV; ++d) acc[d] += w * part[d];
        }
        const float lse_nat = g / kLog2e;
        float scale = 1.f;
        if (p.has_sink) scale = 1.f / (1.f + std::exp(p.attn_sink[r * p.sink_stride + h] - lse_nat));
        for (int d = 0; d < kDimV; ++d) o[d] = float_to_bf16_bits(acc[d] * scale);
        *l = lse_nat;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jsm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCombineCpu, jsm::CombineCpu, jsm::bind_combine(xla::ffi::Ffi::Bind()));

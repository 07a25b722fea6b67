// CPU handler of jsm_decode: the split-KV decode pass in plain C++, float32 math.
// Walks the same schedule as the GPU kernel, so the combine path runs in CI.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/problem.h"

namespace jsm {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Eight independent partial sums so the compiler can vectorise without -ffast-math.
float dot(const float* a, const float* b, int n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int k = 0; k < 8; ++k) s += acc[k];
  return s;
}

// Dequantised keys of the valid entries one piece of one query row attends to.
struct PieceKeys {
  std::vector<float> k;  // [n, d_qk]
  int n = 0;
};

void gather_piece(const DecodeProblem& p, int r, int s, int block_begin, int block_end, PieceKeys* keys) {
  const int main_len = clamp_length(p.topk_length[r], p.topk);
  const int extra_len = p.extra_topk > 0 ? clamp_length(p.extra_topk_length[r], p.extra_topk) : 0;
  keys->n = 0;
  keys->k.clear();
  for (int blk = block_begin; blk < block_end; ++blk) {
    const BlockSpan span = block_span(blk, main_len, extra_len);
    const int32_t* row = span.extra ? p.extra_indices + (int64_t{r} * p.s_q + s) * p.extra_topk
                                    : p.indices + (int64_t{r} * p.s_q + s) * p.topk;
    const uint8_t* cache = span.extra ? p.extra_kv : p.kv;
    const int64_t page_size = span.extra ? p.extra_page_size : p.page_size;
    const int64_t limit = span.extra ? p.extra_num_tokens : p.num_tokens;
    for (int t = span.begin; t < span.end; ++t) {
      const int64_t idx = row[t];
      if (idx < 0 || idx >= limit) continue;  // masked, never read
      const TokenAddress a = token_address(cache, p.format, page_size, idx);
      keys->k.resize(static_cast<size_t>(keys->n + 1) * p.d_qk);
      float* dst = keys->k.data() + static_cast<size_t>(keys->n) * p.d_qk;
      for (int d = 0; d < p.d_qk; ++d) dst[d] = dequant_dim(a, p.format, d);
      ++keys->n;
    }
  }
}

// Attention of one head over the gathered keys. Returns the natural-log lse
// (+inf when there are no keys) and writes the normalised output to `o`.
float attend(const DecodeProblem& p, const float* q, const PieceKeys& keys, std::vector<float>& z, float* o) {
  std::fill(o, o + kDimV, 0.f);
  if (keys.n == 0) return kInf;
  z.resize(keys.n);
  float mx = -kInf;
  for (int j = 0; j < keys.n; ++j) {
    z[j] = p.sm_scale * dot(q, keys.k.data() + static_cast<size_t>(j) * p.d_qk, p.d_qk);
    mx = std::fmax(mx, z[j]);
  }
  float sum = 0.f;
  for (int j = 0; j < keys.n; ++j) {
    const float w = std::exp(z[j] - mx);
    sum += w;
    const float* v = keys.k.data() + static_cast<size_t>(j) * p.d_qk;
    for (int d = 0; d < kDimV; ++d) o[d] += w * v[d];
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < kDimV; ++d) o[d] *= inv;
  return std::log(sum) + mx;
}

int request_blocks(const DecodeProblem& p, int r) {
  const int extra_len = p.extra_topk > 0 ? clamp_length(p.extra_topk_length[r], p.extra_topk) : 0;
  return main_blocks(clamp_length(p.topk_length[r], p.topk)) + extra_blocks(extra_len);
}

// A plan made for other lengths (a stale reused plan) would silently skip or repeat blocks:
// check that the workers cover every block of every request once, in pieces that agree with
// num_splits. The plan depends only on block counts, so this accepts exactly the valid plans.
ffi::Error check_schedule(const DecodeProblem& p) {
  if (p.num_splits[0] != 0) return invalid("plan: num_splits[0] must be 0; make plans with plan_decode");
  std::vector<int> next_block(p.batch, 0), pieces(p.batch, 0);
  for (int w = 0; w < p.num_parts; ++w) {
    const int32_t* row = p.sched + w * kSchedFields;
    const int begin_req = row[kBeginReq], end_req = row[kEndReq];
    if (begin_req > end_req) continue;  // empty worker
    if (begin_req < 0 || end_req >= p.batch) return invalid("plan: a worker names a request out of range");
    for (int r = begin_req; r <= end_req; ++r) {
      const int lo = r == begin_req ? row[kBeginBlock] : 0;
      const int hi = r == end_req ? row[kEndBlock] : request_blocks(p, r);
      const int piece = r == begin_req ? row[kBeginSplit] : 0;
      if (lo != next_block[r] || hi <= lo || hi > request_blocks(p, r) || piece != pieces[r])
        return invalid("plan does not match topk_length / extra_topk_length (request " + std::to_string(r) +
                       "): a plan must be made from the same lengths as the call that uses it");
      next_block[r] = hi;
      ++pieces[r];
    }
  }
  for (int r = 0; r < p.batch; ++r) {
    if (next_block[r] != request_blocks(p, r) || p.num_splits[r + 1] - p.num_splits[r] != pieces[r])
      return invalid("plan does not match topk_length / extra_topk_length (request " + std::to_string(r) +
                     "): a plan must be made from the same lengths as the call that uses it");
  }
  return ffi::Error::Success();
}

ffi::Error DecodeCpu(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                     ffi::Buffer<ffi::S32> topk_length, ffi::AnyBuffer extra_kv, ffi::Buffer<ffi::S32> extra_indices,
                     ffi::Buffer<ffi::S32> extra_topk_length, ffi::Buffer<ffi::F32> attn_sink,
                     ffi::Buffer<ffi::S32> sched, ffi::Buffer<ffi::S32> num_splits, float sm_scale, int32_t kv_format,
                     int64_t page_size, int64_t extra_page_size, bool has_sink, bool batch_invariant,
                     ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::F32>> out_accum,
                     ffi::Result<ffi::Buffer<ffi::F32>> lse_accum) {
  DecodeProblem p;
  JSM_RETURN_IF_ERROR(make_decode_problem(q, kv, indices, topk_length, extra_kv, extra_indices, extra_topk_length,
                                          attn_sink, sched, num_splits, sm_scale, kv_format, page_size,
                                          extra_page_size, has_sink, batch_invariant, out, lse, out_accum, lse_accum,
                                          &p));
  JSM_RETURN_IF_ERROR(check_schedule(p));
  const int64_t slots = static_cast<int64_t>(p.batch) + p.num_parts;
  PieceKeys keys;
  std::vector<float> qf(p.d_qk), z, o(kDimV);
  for (int w = 0; w < p.num_parts; ++w) {
    const int32_t* row = p.sched + w * kSchedFields;
    const int begin_req = row[kBeginReq], end_req = row[kEndReq];
    if (begin_req > end_req) continue;  // empty worker (check_schedule vetted the rest)
    for (int r = begin_req; r <= end_req; ++r) {
      const int block_begin = r == begin_req ? row[kBeginBlock] : 0;
      const int block_end = r == end_req ? row[kEndBlock] : request_blocks(p, r);
      const int pieces = p.num_splits[r + 1] - p.num_splits[r];
      const int slot = p.num_splits[r] + (r == begin_req ? row[kBeginSplit] : 0);
      if (pieces > 1 && (slot < 0 || slot >= slots)) return invalid("plan: split slot out of range");
      for (int s = 0; s < p.s_q; ++s) {
        gather_piece(p, r, s, block_begin, block_end, &keys);
        for (int h = 0; h < p.h_q; ++h) {
          const uint16_t* qrow = p.q + ((int64_t{r} * p.s_q + s) * p.h_q + h) * p.d_qk;
          for (int d = 0; d < p.d_qk; ++d) qf[d] = bf16_bits_to_float(qrow[d]);
          const float l = attend(p, qf.data(), keys, z, o.data());
          if (pieces > 1) {  // a partial for the combine pass, lse in base 2
            float* dst = p.out_accum + ((int64_t{slot} * p.s_q + s) * p.h_q + h) * kDimV;
            std::memcpy(dst, o.data(), kDimV * sizeof(float));
            p.lse_accum[(int64_t{slot} * p.s_q + s) * p.h_q + h] = l == kInf ? -kInf : l * kLog2e;
            continue;
          }
          float scale = 1.f;
          if (p.has_sink && l != kInf) scale = 1.f / (1.f + std::exp(p.attn_sink[r * p.sink_stride + h] - l));
          uint16_t* dst = p.out + ((int64_t{r} * p.s_q + s) * p.h_q + h) * kDimV;
          for (int d = 0; d < kDimV; ++d) dst[d] = float_to_bf16_bits(o[d] * scale);
          p.lse[(int64_t{r} * p.h_q + h) * p.s_q + s] = l;
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jsm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDecodeCpu, jsm::DecodeCpu, jsm::bind_decode(xla::ffi::Ffi::Bind()));

// FFI bindings and the checked description of one decode call, shared by the CPU
// and CUDA handlers so both accept exactly the same operands.
//
// Python validates everything at trace time with readable messages; the checks
// here are a backstop that returns ffi::Error instead of reading out of bounds.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/kv_format.h"
#include "common/split_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jsm {

namespace ffi = xla::ffi;

// ---- bindings (operand order is the contract with jax_sparse_mla/ops.py) ----

// jsm_plan(topk_length[b] i32, extra_topk_length[b] i32)
//   attrs: topk, extra_topk, num_parts, fit_to_device (bool), parts_divisor, batch_invariant (bool)
//   -> sched[num_parts, 8] i32, num_splits[b + 1] i32
// With fit_to_device, the CUDA handler uses min(num_parts, max(SMs / parts_divisor, 1))
// workers and leaves the rest empty; the CPU handler always uses num_parts.
// batch_invariant: the chunked plan of split_plan.h (fit_to_device must then be false).
template <typename B>
auto bind_plan(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Attr<int64_t>("topk")
      .template Attr<int64_t>("extra_topk")
      .template Attr<int64_t>("num_parts")
      .template Attr<bool>("fit_to_device")
      .template Attr<int64_t>("parts_divisor")
      .template Attr<bool>("batch_invariant")
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>();
}

// jsm_decode(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices,
//            extra_topk_length, attn_sink, sched, num_splits)
//   attrs: sm_scale (f32), kv_format (i32), page_size, extra_page_size, has_sink,
//          batch_invariant (the plan is batch-invariant: one kernel for every head count)
//   -> out[b,s_q,h_q,512] bf16, lse[b,h_q,s_q] f32,
//      out_accum[b+P,s_q,h_q,512] f32, lse_accum[b+P,s_q,h_q] f32
template <typename B>
auto bind_decode(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()              // q
      .template Arg<ffi::AnyBuffer>()              // kv_cache (bytes)
      .template Arg<ffi::Buffer<ffi::S32>>()       // indices
      .template Arg<ffi::Buffer<ffi::S32>>()       // topk_length
      .template Arg<ffi::AnyBuffer>()              // extra_kv_cache (bytes)
      .template Arg<ffi::Buffer<ffi::S32>>()       // extra_indices
      .template Arg<ffi::Buffer<ffi::S32>>()       // extra_topk_length
      .template Arg<ffi::Buffer<ffi::F32>>()       // attn_sink
      .template Arg<ffi::Buffer<ffi::S32>>()       // sched
      .template Arg<ffi::Buffer<ffi::S32>>()       // num_splits
      .template Attr<float>("sm_scale")
      .template Attr<int32_t>("kv_format")
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("extra_page_size")
      .template Attr<bool>("has_sink")
      .template Attr<bool>("batch_invariant")
      .template Ret<ffi::AnyBuffer>()              // out (bf16)
      .template Ret<ffi::Buffer<ffi::F32>>()       // lse
      .template Ret<ffi::Buffer<ffi::F32>>()       // out_accum
      .template Ret<ffi::Buffer<ffi::F32>>();      // lse_accum
}

// jsm_combine(out, lse, out_accum, lse_accum, num_splits, attn_sink)
//   attrs: has_sink  -> out, lse (aliased to operands 0 and 1)
template <typename B>
auto bind_combine(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()              // out (bf16), aliased
      .template Arg<ffi::Buffer<ffi::F32>>()       // lse, aliased
      .template Arg<ffi::Buffer<ffi::F32>>()       // out_accum
      .template Arg<ffi::Buffer<ffi::F32>>()       // lse_accum
      .template Arg<ffi::Buffer<ffi::S32>>()       // num_splits
      .template Arg<ffi::Buffer<ffi::F32>>()       // attn_sink
      .template Attr<bool>("has_sink")
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

// ---- the checked problem ----

struct DecodeProblem {
  KVFormat format;
  int batch, s_q, h_q, d_qk, topk, extra_topk, num_parts;
  int64_t page_size, extra_page_size;
  int64_t num_tokens, extra_num_tokens;  // valid index range of each cache
  float sm_scale;
  bool has_sink;
  bool batch_invariant;  // results must not depend on h_q either (no few-heads kernel)
  const uint16_t* q;           // bf16 bits [b, s_q, h_q, d_qk]
  const uint8_t* kv;
  const int32_t* indices;      // [b, s_q, topk]
  const int32_t* topk_length;  // [b]
  const uint8_t* extra_kv;
  const int32_t* extra_indices;      // [b, s_q, extra_topk]
  const int32_t* extra_topk_length;  // [b]
  const float* attn_sink;            // [h_q] or [b, h_q]
  int64_t sink_stride;               // 0 or h_q (see check_sink)
  const int32_t* sched;              // [num_parts, 8]
  const int32_t* num_splits;         // [b + 1]
  uint16_t* out;                     // bf16 bits [b, s_q, h_q, 512]
  float* lse;                        // [b, h_q, s_q]
  float* out_accum;                  // [b + num_parts, s_q, h_q, 512]
  float* lse_accum;                  // [b + num_parts, s_q, h_q]
};

inline std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline bool is_byte_type(ffi::DataType t) {
  return t == ffi::DataType::U8 || t == ffi::DataType::S8 || t == ffi::DataType::F8E4M3FN;
}

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_sparse_mla: " + msg);
}

template <typename Buf>
ffi::Error expect_dims(const char* name, const Buf& buf, std::initializer_list<int64_t> want) {
  auto d = buf.dimensions();
  bool ok = d.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) {
    if (!ok) break;
    ok = d[i++] == w;
  }
  if (!ok) {
    std::string ws = "[";
    i = 0;
    for (int64_t w : want) ws += (i++ ? ", " : "") + std::to_string(w);
    return invalid(std::string(name) + ": expected shape " + ws + "], got " + dims_str(d));
  }
  return ffi::Error::Success();
}

// attn_sink is [h_q] (one sink per head, the public API) or [b, h_q] (per request, which
// vmap uses when the sink itself is mapped). Sink of request r, head h: sink[r * stride + h].
template <typename Buf>
ffi::Error check_sink(const Buf& sink, int64_t b, int64_t h, int64_t* stride) {
  auto d = sink.dimensions();
  if (d.size() == 1 && d[0] == h) {
    *stride = 0;
  } else if (d.size() == 2 && d[0] == b && d[1] == h) {
    *stride = h;
  } else {
    return invalid("attn_sink: expected shape [" + std::to_string(h) + "] or [" + std::to_string(b) + ", " +
                   std::to_string(h) + "], got " + dims_str(d));
  }
  return ffi::Error::Success();
}

#define JSM_RETURN_IF_ERROR(expr)           \
  do {                                      \
    ffi::Error jsm_err_ = (expr);           \
    if (jsm_err_.failure()) return jsm_err_; \
  } while (0)

// The plan attributes both plan handlers accept; a batch-invariant plan needs a worker
// boundary between any two chunks of one request.
inline ffi::Error check_plan_attrs(int64_t batch, int64_t topk, int64_t extra_topk, int64_t num_parts,
                                   bool fit_to_device, bool batch_invariant) {
  if (batch < 1) return invalid("plan: batch must be >= 1, got " + std::to_string(batch));
  if (num_parts < 1) return invalid("plan: num_parts must be >= 1, got " + std::to_string(num_parts));
  if (topk < 1) return invalid("plan: topk must be >= 1, got " + std::to_string(topk));
  if (extra_topk < 0) return invalid("plan: extra_topk must be >= 0, got " + std::to_string(extra_topk));
  if (!batch_invariant) return ffi::Error::Success();
  if (fit_to_device) return invalid("plan: a batch-invariant plan cannot be fitted to the device");
  const int64_t need = invariant_parts_needed(batch, static_cast<int>(topk), static_cast<int>(extra_topk));
  if (num_parts < need)
    return invalid("plan: a batch-invariant plan needs num_parts >= 1 + b * (max_chunks(topk, extra_topk) - 1) = " +
                   std::to_string(need) + ", got " + std::to_string(num_parts));
  return ffi::Error::Success();
}

inline ffi::Error make_decode_problem(
    ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::S32> topk_length,
    ffi::AnyBuffer extra_kv, ffi::Buffer<ffi::S32> extra_indices, ffi::Buffer<ffi::S32> extra_topk_length,
    ffi::Buffer<ffi::F32> attn_sink, ffi::Buffer<ffi::S32> sched, ffi::Buffer<ffi::S32> num_splits, float sm_scale,
    int32_t kv_format, int64_t page_size, int64_t extra_page_size, bool has_sink, bool batch_invariant,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::F32>> out_accum, ffi::Result<ffi::Buffer<ffi::F32>> lse_accum, DecodeProblem* p) {
  if (kv_format != 0 && kv_format != 1) return invalid("kv_format must be 0 (V32) or 1 (MODEL1)");
  p->format = static_cast<KVFormat>(kv_format);
  if (q.element_type() != ffi::DataType::BF16) return invalid("q must be bfloat16");
  auto qd = q.dimensions();
  if (qd.size() != 4) return invalid("q: expected rank 4, got shape " + dims_str(qd));
  p->batch = static_cast<int>(qd[0]);
  p->s_q = static_cast<int>(qd[1]);
  p->h_q = static_cast<int>(qd[2]);
  p->d_qk = static_cast<int>(qd[3]);
  if (p->d_qk != dim_qk(p->format))
    return invalid("q: last dim " + std::to_string(p->d_qk) + " does not match the cache format");
  auto id = indices.dimensions();
  if (id.size() != 3) return invalid("indices: expected rank 3, got " + dims_str(id));
  p->topk = static_cast<int>(id[2]);
  auto ed = extra_indices.dimensions();
  if (ed.size() != 3) return invalid("extra_indices: expected rank 3, got " + dims_str(ed));
  p->extra_topk = static_cast<int>(ed[2]);
  auto sd = sched.dimensions();
  if (sd.size() != 2 || sd[1] != kSchedFields) return invalid("sched: expected [num_parts, 8], got " + dims_str(sd));
  p->num_parts = static_cast<int>(sd[0]);
  const int64_t b = p->batch, s = p->s_q, h = p->h_q;
  JSM_RETURN_IF_ERROR(expect_dims("indices", indices, {b, s, p->topk}));
  JSM_RETURN_IF_ERROR(expect_dims("extra_indices", extra_indices, {b, s, p->extra_topk}));
  JSM_RETURN_IF_ERROR(expect_dims("topk_length", topk_length, {b}));
  JSM_RETURN_IF_ERROR(expect_dims("extra_topk_length", extra_topk_length, {b}));
  JSM_RETURN_IF_ERROR(check_sink(attn_sink, b, h, &p->sink_stride));
  JSM_RETURN_IF_ERROR(expect_dims("num_splits", num_splits, {b + 1}));
  JSM_RETURN_IF_ERROR(expect_dims("lse", *lse, {b, h, s}));
  JSM_RETURN_IF_ERROR(expect_dims("out_accum", *out_accum, {b + p->num_parts, s, h, kDimV}));
  JSM_RETURN_IF_ERROR(expect_dims("lse_accum", *lse_accum, {b + p->num_parts, s, h}));
  if (out->element_type() != ffi::DataType::BF16) return invalid("out must be bfloat16");
  JSM_RETURN_IF_ERROR(expect_dims("out", *out, {b, s, h, kDimV}));
  if (!is_byte_type(kv.element_type()) || !is_byte_type(extra_kv.element_type()))
    return invalid("kv caches must be uint8, int8 or float8_e4m3fn");
  if (page_size < 1 || extra_page_size < 1) return invalid("page sizes must be >= 1");
  const int64_t bpt = bytes_per_token(p->format);
  // Only whole pages are addressable (MODEL1 is page-planar).
  p->num_tokens = static_cast<int64_t>(kv.size_bytes()) / (page_size * bpt) * page_size;
  p->extra_num_tokens = static_cast<int64_t>(extra_kv.size_bytes()) / (extra_page_size * bpt) * extra_page_size;
  if (p->extra_topk == 0) p->extra_num_tokens = 0;
  p->page_size = page_size;
  p->extra_page_size = extra_page_size;
  p->sm_scale = sm_scale;
  p->has_sink = has_sink;
  p->batch_invariant = batch_invariant;
  p->q = reinterpret_cast<const uint16_t*>(q.untyped_data());
  p->kv = reinterpret_cast<const uint8_t*>(kv.untyped_data());
  p->indices = indices.typed_data();
  p->topk_length = topk_length.typed_data();
  p->extra_kv = reinterpret_cast<const uint8_t*>(extra_kv.untyped_data());
  p->extra_indices = extra_indices.typed_data();
  p->extra_topk_length = extra_topk_length.typed_data();
  p->attn_sink = attn_sink.typed_data();
  p->sched = sched.typed_data();
  p->num_splits = num_splits.typed_data();
  p->out = reinterpret_cast<uint16_t*>(out->untyped_data());
  p->lse = lse->typed_data();
  p->out_accum = out_accum->typed_data();
  p->lse_accum = lse_accum->typed_data();
  return ffi::Error::Success();
}

// The combine pass needs the sizes and a few pointers.
struct CombineProblem {
  int batch, s_q, h_q, num_parts;
  bool has_sink;
  const uint16_t* out_src;  // operand 0; normally == out
  const float* lse_src;     // operand 1; normally == lse
  uint16_t* out;
  float* lse;
  const float* out_accum;
  const float* lse_accum;
  const int32_t* num_splits;
  const float* attn_sink;
  int64_t sink_stride;
};

inline ffi::Error make_combine_problem(ffi::AnyBuffer out_in, ffi::Buffer<ffi::F32> lse_in,
                                       ffi::Buffer<ffi::F32> out_accum, ffi::Buffer<ffi::F32> lse_accum,
                                       ffi::Buffer<ffi::S32> num_splits, ffi::Buffer<ffi::F32> attn_sink,
                                       bool has_sink, ffi::Result<ffi::AnyBuffer> out,
                                       ffi::Result<ffi::Buffer<ffi::F32>> lse, CombineProblem* p) {
  if (out_in.element_type() != ffi::DataType::BF16 || out->element_type() != ffi::DataType::BF16)
    return invalid("combine: out must be bfloat16");
  auto od = out->dimensions();
  if (od.size() != 4 || od[3] != kDimV) return invalid("combine: out must be [b, s_q, h_q, 512], got " + dims_str(od));
  p->batch = static_cast<int>(od[0]);
  p->s_q = static_cast<int>(od[1]);
  p->h_q = static_cast<int>(od[2]);
  auto ad = out_accum.dimensions();
  if (ad.size() != 4) return invalid("combine: out_accum must have rank 4, got " + dims_str(ad));
  p->num_parts = static_cast<int>(ad[0]) - p->batch;
  const int64_t b = p->batch, s = p->s_q, h = p->h_q;
  JSM_RETURN_IF_ERROR(expect_dims("out_accum", out_accum, {b + p->num_parts, s, h, kDimV}));
  JSM_RETURN_IF_ERROR(expect_dims("lse_accum", lse_accum, {b + p->num_parts, s, h}));
  JSM_RETURN_IF_ERROR(expect_dims("lse", *lse, {b, h, s}));
  JSM_RETURN_IF_ERROR(expect_dims("num_splits", num_splits, {b + 1}));
  JSM_RETURN_IF_ERROR(check_sink(attn_sink, b, h, &p->sink_stride));
  // XLA aliases out/lse to operands 0/1; if it ever does not, handlers copy first.
  p->out_src = reinterpret_cast<const uint16_t*>(out_in.untyped_data());
  p->lse_src = lse_in.typed_data();
  p->has_sink = has_sink;
  p->out = reinterpret_cast<uint16_t*>(out->untyped_data());
  p->lse = lse->typed_data();
  p->out_accum = out_accum.typed_data();
  p->lse_accum = lse_accum.typed_data();
  p->num_splits = num_splits.typed_data();
  p->attn_sink = attn_sink.typed_data();
  return ffi::Error::Success();
}

}  // namespace jsm

// The decode kernel's parameters, the walk over a worker's blocks (SPEC §6), where a
// list entry's bytes are, and the exact FP8 -> bf16 rule.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/kv_format.h"
#include "common/problem.h"
#include "common/split_plan.h"
#include "cuda/cuda_util.cuh"

namespace jsm {
namespace cuda {

constexpr int kRows = 64;               // heads per CTA
constexpr int kTokens = kBlockEntries;  // 64 entries per block
constexpr float kInitMax = -1e30f;      // running max before any entry (finite: no inf - inf)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

struct Params {
  const uint16_t* q;
  const uint8_t* kv;
  const int32_t* indices;
  const int32_t* topk_length;
  const uint8_t* extra_kv;
  const int32_t* extra_indices;
  const int32_t* extra_topk_length;
  const float* attn_sink;
  int64_t sink_stride;  // 0: one sink per head; h_q: per request
  const int32_t* sched;
  const int32_t* num_splits;
  uint16_t* out;
  float* lse;
  float* out_accum;
  float* lse_accum;
  int64_t num_tokens, extra_num_tokens;
  int64_t page_size, extra_page_size;
  int batch, s_q, h_q, topk, extra_topk;
  float scale_log2;
  int has_sink;
  int kv_align16, extra_align16;  // 16-byte copies possible (else 8-byte)
  int debug;  // timing experiments only (compile-time JSM_TIMING_EXPERIMENT): 1 skips the gathers, 2 the MMAs
};


inline Params make_params(const DecodeProblem& dp) {
  Params p;
  p.q = dp.q;
  p.kv = dp.kv;
  p.indices = dp.indices;
  p.topk_length = dp.topk_length;
  p.extra_kv = dp.extra_kv;
  p.extra_indices = dp.extra_indices;
  p.extra_topk_length = dp.extra_topk_length;
  p.attn_sink = dp.attn_sink;
  p.sink_stride = dp.sink_stride;
  p.sched = dp.sched;
  p.num_splits = dp.num_splits;
  p.out = dp.out;
  p.lse = dp.lse;
  p.out_accum = dp.out_accum;
  p.lse_accum = dp.lse_accum;
  p.num_tokens = dp.num_tokens;
  p.extra_num_tokens = dp.extra_num_tokens;
  p.page_size = dp.page_size;
  p.extra_page_size = dp.extra_page_size;
  p.batch = dp.batch;
  p.s_q = dp.s_q;
  p.h_q = dp.h_q;
  p.topk = dp.topk;
  p.extra_topk = dp.extra_topk;
  p.scale_log2 = dp.sm_scale * kLog2e;
  p.has_sink = dp.has_sink ? 1 : 0;
  // Timing experiments only, never in a shipped build: compile with
  // -DJSM_TIMING_EXPERIMENT=1 (skip gathers) or 2 (skip MMAs); results are then wrong.
#ifdef JSM_TIMING_EXPERIMENT
  p.debug = JSM_TIMING_EXPERIMENT;
#else
  p.debug = 0;
#endif
  const int64_t bpt = bytes_per_token(dp.format);
  auto aligned16 = [&](const uint8_t* base, int64_t ps) {
    return (reinterpret_cast<uintptr_t>(base) % 16 == 0) && ((ps * bpt) % 16 == 0) &&
           (dp.format == KVFormat::kV32 || (Model1Layout::kDataBytes % 16 == 0));
  };
  p.kv_align16 = aligned16(dp.kv, dp.page_size) ? 1 : 0;
  p.extra_align16 = aligned16(dp.extra_kv, dp.extra_page_size) ? 1 : 0;
  return p;
}

// Launches the kernel (decode_wgmma.cu) on the checked problem.
ffi::Error launch_wgmma(const DecodeProblem& dp, cudaStream_t stream);

// Position in a worker's sequence of blocks.
struct Cursor {
  int r;    // request (> end_req: past the end)
  int blk;  // block within the request
  int end;  // one past this worker's last block of the request
  int mlen, elen;
};

__device__ __forceinline__ void cursor_enter(Cursor& c, const Params& p, int r, int first_blk, int end_req,
                                             int end_block) {
  c.r = r;
  if (r > end_req) return;
  c.mlen = clamp_length(p.topk_length[r], p.topk);
  c.elen = clamp_length(p.extra_topk_length[r], p.extra_topk);
  c.blk = first_blk;
  c.end = r == end_req ? end_block : main_blocks(c.mlen) + extra_blocks(c.elen);
}

__device__ __forceinline__ void cursor_advance(Cursor& c, const Params& p, int end_req, int end_block) {
  if (c.r > end_req) return;
  if (++c.blk >= c.end) cursor_enter(c, p, c.r + 1, 0, end_req, end_block);
}

// One list entry of a block, as seen by the threads that copy it: where its bytes are
// (computed one block ahead, so the index load and the address math are off the

struct TokenRef {
  const uint8_t* data;    // the token's bytes (MODEL1: region A); any mapped address if invalid
  const uint8_t* scales;  // MODEL1: the token's 8 scale bytes (region B)
  int valid;
  int a16;  // 16-byte copies possible
};

// A list entry's index as loaded (kind 0: no entry; 1: main list; 2: extra list), kept
// apart from the address math so that a loop can load indices a block ahead.
struct EntryIndex {
  int idx;
  int kind;
};

__device__ __forceinline__ EntryIndex load_entry(const Cursor& c, const Params& p, int s, int end_req, int tok) {
  EntryIndex x{0, 0};
  if (c.r > end_req) return x;
  const BlockSpan sp = block_span(c.blk, c.mlen, c.elen);
  const int e = sp.begin + tok;
  if (e >= sp.end) return x;
  if (sp.extra) {
    x.idx = __ldg(p.extra_indices + (static_cast<int64_t>(c.r) * p.s_q + s) * p.extra_topk + e);
    x.kind = 2;
  } else {
    x.idx = __ldg(p.indices + (static_cast<int64_t>(c.r) * p.s_q + s) * p.topk + e);
    x.kind = 1;
  }
  return x;
}

template <KVFormat F>
__device__ __forceinline__ TokenRef resolve_entry(const EntryIndex& x, const Params& p) {
  TokenRef t{p.kv, p.kv, 0, 1};
  if (x.kind == 0) return t;
  const bool extra = x.kind == 2;
  const int idx = x.idx;
  t.valid = idx >= 0 && static_cast<int64_t>(idx) < (extra ? p.extra_num_tokens : p.num_tokens);
  if (!t.valid) return t;
  const uint8_t* cache = extra ? p.extra_kv : p.kv;
  t.a16 = extra ? p.extra_align16 : p.kv_align16;
  if (F == KVFormat::kV32) {
    t.data = cache + static_cast<int64_t>(idx) * V32Layout::kBytesPerToken;
    t.scales = t.data;
  } else {
    const int64_t ps = extra ? p.extra_page_size : p.page_size;
    const uint32_t ups = static_cast<uint32_t>(ps);
    const uint32_t page = static_cast<uint32_t>(idx) / ups;
    const uint32_t slot = static_cast<uint32_t>(idx) - page * ups;
    const uint8_t* pb = cache + static_cast<int64_t>(page) * ps * Model1Layout::kBytesPerToken;
    t.data = pb + static_cast<int64_t>(slot) * Model1Layout::kDataBytes;
    t.scales = pb + ps * Model1Layout::kDataBytes + static_cast<int64_t>(slot) * Model1Layout::kScaleBytes;
  }
  return t;
}

// ---- dequantization (SPEC §2) ----
//
// An e4m3fn code b, placed as (b & 0x80) << 8 | (b & 0x7f) << 4, is the bf16 of
// code * 2^-120 exactly (subnormal codes included). One bf16 multiply by
// bf16(scale) * 2^120 then gives bf16(code * bf16(scale)) with one rounding, as the
// rule asks. When bf16(scale) * 2^120 would overflow (finite scale >= 2^8) we first
// multiply by 2^120 (exact) and then by bf16(scale). NaN codes (0x7f, 0xff) are
// detected per thread; one NaN written into the token's row makes the token's logit
// NaN, which makes every output of the row NaN exactly as the exact rule does.

struct ScaleMul {
  uint32_t mul2;  // bf16x2 multiplier
  bool slow;      // multiply by 2^120 first
};

__device__ __forceinline__ ScaleMul scale_mul(float sb) {
  const float pre = sb * 0x1p120f;
  ScaleMul m;
  m.slow = isinf(pre) && !isinf(sb);
  const uint32_t bits = __float_as_uint(m.slow ? sb : pre) >> 16;  // exact: both are bf16 values
  m.mul2 = bits | (bits << 16);
  return m;
}

// Two floats -> bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t fp8x2_raw(uint32_t w, uint32_t sel) {
  const uint32_t a = __byte_perm(w, 0u, sel);  // code0 << 8 | code1 << 24
  return (a & 0x80008000u) | ((a >> 4) & 0x07f007f0u);
}

// Bit 7 of a byte of the result is set iff that byte of one of the 16 codes is a NaN code.
__device__ __forceinline__ uint32_t nan_flags(const uint4 w) {
  return ((w.x & 0x7f7f7f7fu) + 0x01010101u) | ((w.y & 0x7f7f7f7fu) + 0x01010101u) |
         ((w.z & 0x7f7f7f7fu) + 0x01010101u) | ((w.w & 0x7f7f7f7fu) + 0x01010101u);
}

// 16 codes -> 16 bf16 (two 16-byte vectors). kSlow: multiply by 2^120 first (exact),
// then by `mul2` = bf16(scale); otherwise `mul2` = bf16(scale) * 2^120 (one rounding).
// NaN codes come out finite here: callers check nan_flags.
template <bool kSlow>
__device__ __forceinline__ void dequant16(const uint4 w, uint32_t mul2, uint4& o0, uint4& o1) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
  uint32_t r[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[2 * i] = fp8x2_raw(ws[i], 0x1404u);
    r[2 * i + 1] = fp8x2_raw(ws[i], 0x3424u);
  }
  if (kSlow) {
#pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = bf16x2_mul(r[i], 0x7b807b80u);  // 2^120
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = bf16x2_mul(r[i], mul2);
  o0 = make_uint4(r[0], r[1], r[2], r[3]);
  o1 = make_uint4(r[4], r[5], r[6], r[7]);
}

}  // namespace cuda
}  // namespace jsm

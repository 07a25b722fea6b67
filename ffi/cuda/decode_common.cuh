// The decode kernel's parameters, the walk over a worker's blocks (split_plan.h), where
// a list entry's bytes are, and the FP8 -> bf16 rule (kv_format.h) on packed registers.
#pragma once

#include <cuda.h>  // CUtensorMap
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

// Where the time goes, for kernel work only: build with -DJSM_TIMING_EXPERIMENT=1 to skip
// the cache loads, =2 to skip the MMAs, =3 to skip both, =4 to have the producer write
// nothing (it only signals each buffer full: the consumers' chain alone), =5 to have a pair
// producer send its peer no rows (the valid words only) but store them into the peer entry's
// row of its own tile (what the SM-to-SM path costs beyond the shared-memory writes), =6 the
// same for the RoPE dims alone (what a peer loading its own RoPE could save), =7 as 5 with
// that row converted a second time from sign-flipped codes (nothing shared): the conversions
// of a pair that exchanged raw bytes instead of converted rows, without the raw bytes'
// transfer; =8 to skip the pair producer's L2 prefetch of the block after next (results
// right: what the prefetch buys today); =9 to read every entry from one of the cache's first
// 32 rows (index & 31: they stay in L1, so the loads' instructions and L1 reads remain and
// the trips to L2 and memory go); =11 to keep a worker's first Q for all its pieces (no
// reload, and no wait for one at a piece's first QK: what fetching Q mid-walk costs); =12 to
// skip the output stores of every piece but a worker's last (what the stores cost where all
// workers cross into their next request at once). Results are then wrong (but for 8).
// (10 is retired: 4 entries x 128 bytes a row-load instruction, +2.5% in session 47.)
// A compile-time constant: a shipped build has no trace of it.
#ifdef JSM_TIMING_EXPERIMENT
constexpr int kTimingExperiment = JSM_TIMING_EXPERIMENT;
#else
constexpr int kTimingExperiment = 0;
#endif
constexpr bool kSkipStores = kTimingExperiment == 4;
constexpr bool kSkipLoads = kTimingExperiment == 1 || kTimingExperiment == 3 || kSkipStores;
constexpr bool kSkipMma = kTimingExperiment == 2 || kTimingExperiment == 3;
constexpr bool kConvertPeerRows = kTimingExperiment == 7;
constexpr bool kSkipPeerRows = kTimingExperiment == 5 || kConvertPeerRows;
constexpr bool kSkipPeerRope = kTimingExperiment == 6 || kSkipPeerRows;
constexpr bool kSkipPrefetch = kTimingExperiment == 8;
constexpr bool kFixedRows = kTimingExperiment == 9;
constexpr bool kKeepFirstQ = kTimingExperiment == 11;
constexpr bool kSkipMidWalkStores = kTimingExperiment == 12;

struct Params {
  // Q as a 3-d bf16 tensor {d_qk, h_q, batch * s_q} for the 64-row kernels' bulk copies
  // (decode_kernel.cuh, load_q), 128-byte swizzled boxes of 64 x 64; encoded by the launch
  // (decode_launch.cu). First: the map needs 64-byte alignment.
  CUtensorMap q_map;
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
  int num_slots;  // partial slots: batch + num_parts
  float scale_log2;
  int has_sink;
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
  p.num_slots = dp.batch + dp.num_parts;
  p.scale_log2 = dp.sm_scale * kLog2e;
  p.has_sink = dp.has_sink ? 1 : 0;
  return p;
}

// Whether every token row of both caches starts 16-byte aligned, so that the kernel may
// read it with 16-byte loads (else 8-byte loads: MODEL1 pages of an odd size).
inline bool caches_aligned16(const DecodeProblem& dp) {
  const int64_t bpt = bytes_per_token(dp.format);
  auto aligned = [&](const uint8_t* base, int64_t ps) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (ps * bpt) % 16 == 0;
  };
  return aligned(dp.kv, dp.page_size) && (dp.extra_topk == 0 || aligned(dp.extra_kv, dp.extra_page_size));
}

// Launches the kernel (decode_launch.cu) on the checked problem.
ffi::Error launch_decode(const DecodeProblem& dp, cudaStream_t stream);

// Blocks of request r for the lengths of this call (split_plan.h).
__device__ __forceinline__ int request_blocks(const Params& p, int r) {
  return main_blocks(clamp_length(p.topk_length[r], p.topk)) +
         extra_blocks(clamp_length(p.extra_topk_length[r], p.extra_topk));
}

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

// A list entry's index as loaded (kind 0: no entry; 1: main list; 2: extra list), kept
// apart from the address math so that a loop can load indices blocks ahead.
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

// Where a list entry's bytes are: `data` is null for an entry that is absent or whose
// index is outside its cache (never read: its row is zeros and its logit -inf).
struct TokenRef {
  const uint8_t* data;    // the token's bytes (MODEL1: region A)
  const uint8_t* scales;  // MODEL1: the token's 8 scale bytes (region B); V32: unused
};

template <KVFormat F>
__device__ __forceinline__ TokenRef resolve_entry(const EntryIndex& x, const Params& p) {
  TokenRef t{nullptr, nullptr};
  if (x.kind == 0) return t;
  const bool extra = x.kind == 2;
  const int idx = kFixedRows ? x.idx & 31 : x.idx;
  if (idx < 0 || static_cast<int64_t>(idx) >= (extra ? p.extra_num_tokens : p.num_tokens)) return t;
  const uint8_t* cache = extra ? p.extra_kv : p.kv;
  if (F == KVFormat::kV32) {
    t.data = cache + static_cast<int64_t>(idx) * V32Layout::kBytesPerToken;
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

// ---- dequantization (kv_format.h: bf16(code * bf16(scale)), one rounding) ----
//
// Hardware conversions all the way: e4m3 pairs -> f16 pairs (exact: every e4m3 value,
// subnormals included, is a normal f16), f16 -> f32 -> bf16 (exact: 4 significant bits),
// then one bf16 multiply by bf16(scale): the product of two bf16 is exact before its
// single rounding, and bf16 has float32's exponent range, so every scale is exact on this
// path. NaN codes and NaN scales come out NaN, as the rule asks.

// Two floats -> bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// bf16(s) in both halves.
__device__ __forceinline__ uint32_t bf16x2_splat(float s) { return pack_bf16x2(s, s); }

// A UE8M0 scale byte (2^(e - 127); 255 is NaN) as bf16 bits in both halves.
__device__ __forceinline__ uint32_t ue8m0_bf16x2(uint32_t e) {
  const uint32_t bits = e == 0 ? 0x0040u : (e == 255 ? 0x7fc0u : e << 7);  // 2^-127 is a bf16 subnormal
  return bits | (bits << 16);
}

// Four e4m3 codes (the first in the low byte) times `scale2`: codes 0, 1 in `lo`, 2, 3 in `hi`.
__device__ __forceinline__ void dequant4(uint32_t w, uint32_t scale2, uint32_t& lo, uint32_t& hi) {
  uint32_t b0, b1;
  asm("{\n"
      ".reg .b16 c01, c23;\n"
      ".reg .b32 h01, h23;\n"
      ".reg .b16 h0, h1, h2, h3;\n"
      ".reg .f32 f0, f1, f2, f3;\n"
      "mov.b32 {c01, c23}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 h01, c01;\n"
      "cvt.rn.f16x2.e4m3x2 h23, c23;\n"
      "mov.b32 {h0, h1}, h01;\n"
      "mov.b32 {h2, h3}, h23;\n"
      "cvt.f32.f16 f0, h0;\n"
      "cvt.f32.f16 f1, h1;\n"
      "cvt.f32.f16 f2, h2;\n"
      "cvt.f32.f16 f3, h3;\n"
      "cvt.rn.bf16x2.f32 %0, f1, f0;\n"
      "cvt.rn.bf16x2.f32 %1, f3, f2;\n"
      "}\n"
      : "=r"(b0), "=r"(b1)
      : "r"(w));
  lo = bf16x2_mul(b0, scale2);
  hi = bf16x2_mul(b1, scale2);
}

// 16 codes -> 16 bf16 (two 16-byte vectors).
__device__ __forceinline__ void dequant16(const uint4 w, uint32_t scale2, uint4& o0, uint4& o1) {
  dequant4(w.x, scale2, o0.x, o0.y);
  dequant4(w.y, scale2, o0.z, o0.w);
  dequant4(w.z, scale2, o1.x, o1.y);
  dequant4(w.w, scale2, o1.z, o1.w);
}

}  // namespace cuda
}  // namespace jsm

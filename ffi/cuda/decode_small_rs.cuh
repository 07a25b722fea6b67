// The few-heads decode kernel (H = 16 or 32 heads, the N of every product)
// with the dequantization in the consumers. The launch (decode_launch.cu) says which calls
// run it. Rather than producers writing every token as bf16 into a shared K tile that wgmma
// reads twice (S^T and O^T: the retired decode_small.cuh, sessions 6-22), the cache bytes stay
// raw in shared memory:
//   producer warpgroup: one bulk copy per row (656 bytes; MODEL1: region A's 576 and a
//     cp.async of the 8 scale bytes) into one of four stages (cp.async pieces for caches not
//     16-byte aligned), zeros for an invalid entry; the stage's `full` barrier tracks them.
//   warpgroup A: S^T = K Q^T from registers (the codes as f16, one conversion per two), the
//     softmax, P^T for B; warpgroup B: O^T = V^T P^T (codes times scale / c in f16), up to
//     kPBufs - 1 blocks behind A (SmemRs::kPBufs P^T buffers: 2 at 16 heads, 3 at 32).
// The f16 arithmetic and its exactness are described at "the f16 products" below. MODEL1's
// 64 RoPE value dims (bf16) get their own bf16 m-tile in B (see consume_pv_f16).
//
// The K dimension of S^T is permuted so that a thread's A fragments of 4 k-steps are one
// 16-byte chunk of a token row (Q is stored in the same order), and the M dimension of
// O^T (the value dims) so that a thread's rows are 16 consecutive dims of every token.
// The tokens of O^T's K dimension are permuted too (P^T is written in that order); the row
// pitch (kRsPitch) keeps both products' loads conflict-free.
#pragma once

#include "cuda/decode_kernel.cuh"

namespace jsm {
namespace cuda {

// The per-head reduction over the 64 tokens: `v` holds this thread's value of each of its
// H/4 columns (heads 8 (j / 2) + 2 c + j % 2) over its two token rows; the result is the
// reduction over all 64 rows, for the same columns. Lanes of one c share columns.
template <int H, bool kMax>
__device__ __forceinline__ void reduce_columns(float (&v)[H / 4], float* red, int warp, int lane,
                                               int bar) {
  const int c = lane & 3;
#pragma unroll
  for (int j = 0; j < H / 4; ++j)
#pragma unroll
    for (int x = 4; x <= 16; x *= 2) {
      const float o = __shfl_xor_sync(0xffffffffu, v[j], x);
      v[j] = kMax ? fmaxf(v[j], o) : v[j] + o;
    }
  if (lane < 4)
#pragma unroll
    for (int j = 0; j < H / 4; ++j) red[warp * H + 8 * (j / 2) + 2 * c + (j & 1)] = v[j];
  named_bar_sync(bar, kWarpgroup);
#pragma unroll
  for (int j = 0; j < H / 4; ++j) {
    const int h = 8 * (j / 2) + 2 * c + (j & 1);
    float a = red[h];
#pragma unroll
    for (int k = 1; k < 4; ++k) a = kMax ? fmaxf(a, red[k * H + h]) : a + red[k * H + h];
    v[j] = a;
  }
  named_bar_sync(bar, kWarpgroup);  // red is free again
}

// Accumulator i of a 64 x H product (H / 2 a thread): row r0 + 8 ((i / 2) % 2), column
// 8 (i / 4) + 2 c + i % 2, i.e. the thread's column j = 2 (i / 4) + i % 2.
__device__ __forceinline__ int acc_column(int i) { return 2 * (i >> 2) + (i & 1); }

// The softmax step of one block over S^T's accumulators (this thread's rows r0, r0 + 8, whose
// entries are valid when v0 / v1): invalid rows get -inf, the running maximum m moves lazily
// (alpha: the factor of what came before), and sacc becomes probabilities 2^(scale s - m),
// added to this thread's share of l (its two rows; the 64 are summed at the piece's end).
// m moves only when a block's maximum exceeds it by kLazyRescale, and in most blocks no
// thread's value does: one vote of the warpgroup (named barrier `vote_bar`) then stands for the
// reduction of each head's maximum over the 64 rows (smem `red`, named barrier `bar`), with the
// same m and alpha = 1. scale > 0: the maximum of the scaled values is the scaled maximum.
template <int H>
__device__ __forceinline__ void block_softmax(float (&sacc)[H / 2], bool v0, bool v1, float (&m)[H / 4],
                                              float (&l)[H / 4], float (&alpha)[H / 4], float scale, float* red,
                                              int warp, int lane, int bar, int vote_bar) {
  if (!(v0 && v1)) {
#pragma unroll
    for (int i = 0; i < H / 2; ++i)
      if (!(((i >> 1) & 1) ? v1 : v0)) sacc[i] = -INFINITY;
  }
  float mx[H / 4];
#pragma unroll
  for (int j = 0; j < H / 4; ++j) mx[j] = -INFINITY;
#pragma unroll
  for (int i = 0; i < H / 2; ++i) mx[acc_column(i)] = fmaxf(mx[acc_column(i)], sacc[i]);
  bool up = false;  // false for NaN and for -inf (all masked), as `grow` below
#pragma unroll
  for (int j = 0; j < H / 4; ++j) up |= mx[j] * scale > m[j] + kLazyRescale;
  if (named_bar_any(vote_bar, kWarpgroup, up)) {
    reduce_columns<H, true>(mx, red, warp, lane, bar);
#pragma unroll
    for (int j = 0; j < H / 4; ++j) {
      const float mx_scaled = mx[j] * scale;
      const bool grow = mx_scaled > m[j] + kLazyRescale;
      const float m_new = grow ? mx_scaled : m[j];
      alpha[j] = grow ? fast_exp2(m[j] - m_new) : 1.f;
      m[j] = m_new;
      l[j] *= alpha[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < H / 4; ++j) alpha[j] = 1.f;
  }
#pragma unroll
  for (int i = 0; i < H / 2; ++i) {
    const int j = acc_column(i);
    sacc[i] = fast_exp2(fmaf(sacc[i], scale, -m[j]));
    l[j] += sacc[i];
  }
}

constexpr int kRsStages = 4;
// A raw row in smem: 42 chunks of 16 bytes (V32 uses 41, MODEL1 37). An even chunk count
// that is not a multiple of 4 spreads both products' loads over all banks without a swizzle:
// S^T's LDS.128 read chunk 4 j + c of rows r0 + g (8 rows, 4 chunks), O^T's chunk 8 w + g of
// 4 rows, and 16-byte unit (2 row + chunk) mod 8 then takes each value 4 times (the
// 4-wavefront minimum).
constexpr int kRsPitch = 672;
constexpr int kRsThreads = 3 * kWarpgroup;  // S^T + softmax, O^T, producer
constexpr int kRsNarrowHeads = 16;  // N of the narrow instance: every call of up to 16 heads runs it
constexpr int kRsMaxHeads = 32;
// Registers after reallocation (the launch gives 168 a thread, 504 for the three). At 32
// heads O^T alone is 128 floats a thread of B; MODEL1's A holds 7 scale tiles' accumulators
// (128 floats at 32 heads: 224 keeps its block loop spill-free) and its B the RoPE m-tile
// (at 32 heads 256, the most setmaxnreg gives, with a few spills; the producer fits in 24).
template <KVFormat F, int H>
struct RsRegs {
  static constexpr bool kV32 = F == KVFormat::kV32;
  static constexpr int kQK = H == 16 ? (kV32 ? 184 : 200) : (kV32 ? 192 : 224);
  static constexpr int kPV = H == 16 ? (kV32 ? 216 : 232) : (kV32 ? 248 : 256);
  static constexpr int kProducer = H == 16 ? (kV32 ? 104 : 72) : (kV32 ? 64 : 24);
  static_assert(kQK + kPV + kProducer <= 3 * 168, "setmaxnreg counts over the launch's");
};
// Named barriers (0 is __syncthreads).
constexpr int kRsBarQ = 1;       // A: its Q copies have landed
constexpr int kRsBarRed = 2;     // A: the per-warp column reductions are in smem
constexpr int kRsMaxPBufs = 3;
constexpr int kRsBarPReady = 3;  // + buffer: A -> B, P^T, alpha (and the piece's factors)
constexpr int kRsBarPFree = kRsBarPReady + kRsMaxPBufs;  // + buffer: B -> A, done with that P^T
constexpr int kRsBarExact = kRsBarPFree + kRsMaxPBufs;  // B: its warps' votes for the exact A path
constexpr int kRsBarGrow = kRsBarExact + 1;  // A: its warps' votes for moving the running maximum
static_assert(kRsBarGrow < 16, "a CTA has 16 named barriers");

// The P^T buffer (and alpha, final-factor slot) of block or piece n >= 0.
template <int kBufs>
__device__ __forceinline__ int p_buffer(int n) {
  return static_cast<int>(static_cast<unsigned>(n) % kBufs);
}

// A token's raw row in smem, in 16-byte chunks: the cache row as it is (V32), or region A
// followed by the scale bytes (MODEL1).
template <KVFormat F>
struct RawRow {
  static constexpr bool kV32 = F == KVFormat::kV32;
  static constexpr int kDataBytes = kV32 ? V32Layout::kBytesPerToken : Model1Layout::kDataBytes;
  static constexpr int kScaleChunk = kV32 ? V32Layout::kScaleOffset / 16 : Model1Layout::kDataBytes / 16;
  static constexpr int kRopeChunk = Fmt<F>::kRopeOffset / 16;
  static_assert(kDataBytes % 16 == 0 && Fmt<F>::kRopeOffset % 16 == 0, "rows of whole chunks");
  static_assert(kDataBytes <= kRsPitch && kScaleChunk * 16 + 16 <= kRsPitch, "the row fits its pitch");
};

template <KVFormat F, int H>
struct SmemRs {
  // P^T buffers: A runs up to kPBufs - 1 blocks ahead of B. At 32 heads B is the slower
  // consumer and each waits on the other at two (sessions 24, 26): a third buffer absorbs
  // their jitter.
  static constexpr int kPBufs = H == 32 ? 3 : 2;
  static_assert(kPBufs <= kRsMaxPBufs, "named barriers for each buffer");
  static constexpr int kQ = 0;  // Q in the permuted k order, K-major B operand
  static constexpr int kPBytes = kTokens * H * 2;
  static constexpr int kP = kQ + Fmt<F>::kDqk * H * 2;  // P^T, kPBufs buffers
  // MODEL1: P^T in bf16 as well (kPBufs buffers), B operand of the RoPE value dims' product.
  static constexpr int kPBf16 = kP + kPBufs * kPBytes;
  static constexpr int kRed = kPBf16 + (F == KVFormat::kV32 ? 0 : kPBufs * kPBytes);  // 4 warps x H floats
  static constexpr int kAlpha = kRed + 4 * H * 4;           // kPBufs x H floats, by P^T buffer
  static constexpr int kFinal = kAlpha + kPBufs * H * 4;    // kPBufs x H floats, by piece
  static constexpr int kQb = kFinal + kPBufs * H * 4;       // H floats: 2^-k of each head's Q
  // MODEL1: UE8M0 byte -> scale, 256 floats (filled at the kernel's start): a byte decodes
  // with a load instead of ~7 integer instructions.
  static constexpr int kScaleTable = kQb + H * 4;
  static constexpr int kRaw = (kScaleTable + (F == KVFormat::kV32 ? 0 : 256 * 4) + 127) / 128 * 128;
  static constexpr int kRawTile = kTokens * kRsPitch;
  static constexpr int kValid = kRaw + kRsStages * kRawTile;  // a stage: 4 words (16 rows each)
  static constexpr int kFull = kValid + kRsStages * 16;
  static constexpr int kEmpty = kFull + kRsStages * 8;
  static constexpr int kBytes = kEmpty + kRsStages * 8;
  static_assert(kBytes <= 232448, "shared memory over the sm_90 per-block limit");
};

// The stage's `full` barrier counts this thread's earlier cp.asyncs (one of its arrivals).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t lds_u8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Four e4m3 codes (the first in the low byte) as f16 pairs, exactly: codes 0, 1 in `lo`.
__device__ __forceinline__ void codes_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 c01, c23;\nmov.b32 {c01, c23}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, c01;\ncvt.rn.f16x2.e4m3x2 %1, c23;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t f16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The smallest power of two >= x (x >= 0 finite; 2^-126 for 0 and subnormals).
__device__ __forceinline__ float pow2_ceil(float x) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t e = b & 0x7f800000u;
  return __uint_as_float(e == 0 ? 0x00800000u : ((b & 0x007fffffu) ? min(e + 0x00800000u, 0x7f000000u) : e));
}

// 1 / c for c = pow2_ceil(x) (a normal power of two up to 2^127), exactly, from c's exponent
// field: a division's slow-path branch and call out of B's block loop. (cn * 1 / c_new is then
// cn / c_new, rounded the same: both round the same real number.)
__device__ __forceinline__ float pow2_reciprocal(float c) {
  const uint32_t e = __float_as_uint(c) >> 23;  // 1 .. 254
  return __uint_as_float(e == 254u ? 0x00400000u : (254u - e) << 23);  // 2^-127 is a subnormal
}

// cp.async of 8 bytes (src_bytes = 0: zeros).
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// The producer copies a 16-byte aligned row with one bulk copy, an unaligned one in 8-byte
// cp.async pieces (the per-piece bookkeeping of 16-byte pieces made that producer the wall:
// NOTES, session 21). A stage's `full` counts the rows' bytes and one arrival a row (V32) or
// two (MODEL1: the second when the row's cp.async of its 8 scale bytes lands), or each
// producer thread's cp.asyncs and 4 arrivals (the valid words).
template <KVFormat F, bool kAligned>
constexpr int kRsFullArrivals = kAligned ? kTokens * (F == KVFormat::kV32 ? 1 : 2) : kWarpgroup + 4;

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to
// this CTA's smem; completion counts on mbarrier `bar` as transaction bytes.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void sts128_zero(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}

// Producer warpgroup: warp pw fills rows 16 pw .. 16 pw + 15 of every block (lane j < 16
// resolves entry 16 pw + j, a block ahead of its copies).
template <KVFormat F, int H, bool kAligned>
__device__ __forceinline__ void produce_rs(const Params& p, const Work& w, int s, uint32_t sb, uint8_t* smem, int t) {
  using L = SmemRs<F, H>;
  using R = RawRow<F>;
  constexpr int kCopy = 8;  // the pieces of an unaligned row
  constexpr int kPerRow = R::kDataBytes / kCopy;
  static_assert(kPerRow >= 32, "a copy index advances by at most one row");
  const int pw = t >> 5;
  const int lane = t & 31;
  const int entry = 16 * pw + (lane & 15);
  uint32_t* valid_words = reinterpret_cast<uint32_t*>(smem + L::kValid);

  Cursor c;
  cursor_enter(c, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  EntryIndex idx = load_entry(c, p, s, w.end_req, entry);
  cursor_advance(c, p, w.end_req, w.end_block);  // c: block n + 1
  for (int n = 0;; ++n) {
    const TokenRef cur = resolve_entry<F>(idx, p);
    const bool has_next = c.r <= w.end_req;
    idx = load_entry(c, p, s, w.end_req, entry);
    cursor_advance(c, p, w.end_req, w.end_block);

    const int stage = n % kRsStages;
    mbar_wait(sb + L::kEmpty + 8 * stage, ((n / kRsStages) & 1) ^ 1);
    const uint32_t tile = sb + L::kRaw + stage * L::kRawTile + 16 * pw * kRsPitch;
    const uint32_t full = sb + L::kFull + 8 * stage;
    const uint32_t v = __ballot_sync(0xffffffffu, cur.data != nullptr) & 0xffffu;
    if (lane == 0) valid_words[4 * stage + pw] = v;  // (published by lane 0's arrival)
    // MODEL1: the row's 8 scale bytes after its data (zeros for an invalid entry).
    const auto copy_scales = [&](uint32_t row) {
      cp_async_8(row + R::kScaleChunk * 16, cur.scales ? cur.scales : p.kv, cur.scales ? 8u : 0u);
    };
    if (kAligned) {  // one bulk copy a row; zeros for an invalid entry
      if (lane < 16) {
        const uint32_t dst = tile + lane * kRsPitch;
        if (!R::kV32) {
          copy_scales(dst);
          cp_async_arrive_noinc(full);
        }
        if (cur.data) {
          mbar_arrive_expect_tx(full, R::kDataBytes);
          bulk_load(dst, cur.data, R::kDataBytes, full);
        } else {
#pragma unroll 1
          for (int i = 0; i < R::kDataBytes / 16; ++i) sts128_zero(dst + 16 * i);
          mbar_arrive(full);
        }
      }
      if (!has_next) break;
      continue;
    }
    const uint64_t mine = reinterpret_cast<uint64_t>(cur.data);
    int row = 0, piece = lane;  // copy lane + 32 i of the warp's 16 x kPerRow
#pragma unroll 2
    for (int i = 0; i < (16 * kPerRow + 31) / 32; ++i) {
      const uint64_t src = __shfl_sync(0xffffffffu, mine, row);
      if (row < 16) {
        const uint8_t* from = src ? reinterpret_cast<const uint8_t*>(src) + kCopy * piece : p.kv;
        const uint32_t dst = tile + row * kRsPitch + kCopy * piece;
        cp_async_8(dst, from, src ? 8u : 0u);
      }
      piece += 32;
      if (piece >= kPerRow) {
        piece -= kPerRow;
        ++row;
      }
    }
    if (!R::kV32 && lane < 16) copy_scales(tile + lane * kRsPitch);
    cp_async_arrive_noinc(full);
    if (lane == 0) mbar_arrive(full);
    if (!has_next) break;
  }
  cp_async_wait_all();
}

// ---- the f16 products (V32) ----
//
// e4m3 codes are exact in f16, so the consumers convert a pair of codes with one instruction
// and the scales move out of the A fragments:
//   S^T: one fp32 accumulator set per scale tile, S = sum_t scale_t(token) S_t (a per-row
//     factor); Q's NoPE dims in f16 times a per-head power of two 2^k_h (its largest |q| in
//     [2^14, 2^15), where f16 holds every bf16 value exactly), undone on S; the RoPE dims stay
//     bf16 (their own accumulators). With power-of-two scales (every quantizer's) the products
//     are the bf16 rule's exactly; other float32 scales skip the rule's rounding of K to bf16.
//   O^T: A = code x (scale / c) in f16, c a power of two per block and scale tile (a thread's
//     rows lie in one tile): O^T is kept in units of c and rescaled (exactly) when c changes.
//     P^T in f16.

// Q of (request r, query row s) for the f16 products, 16 heads from h0 at a time, fetched into
// registers (thread t: head h0 + t / 8, bf16 pairs t % 8 + 8 m of its NoPE and RoPE dims)
// ahead of q_store.
template <KVFormat F>
struct QRegs {
  static constexpr int kNope = Fmt<F>::kNope / 2 / 8;
  static constexpr int kRope = (Fmt<F>::kDqk - Fmt<F>::kNope) / 2 / 8;
  uint32_t nope[kNope];
  uint32_t rope[kRope];
};

template <KVFormat F>
__device__ __forceinline__ void q_fetch(const Params& p, int r, int s, int t, int h0, QRegs<F>& qr) {
  const int h = h0 + (t >> 3);  // 8 threads a head
  const bool ok = h < p.h_q;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(
      p.q + ((static_cast<int64_t>(r) * p.s_q + s) * p.h_q + (ok ? h : 0)) * Fmt<F>::kDqk);
#pragma unroll
  for (int m = 0; m < QRegs<F>::kNope; ++m) qr.nope[m] = ok ? __ldg(src + (t & 7) + 8 * m) : 0u;
#pragma unroll
  for (int m = 0; m < QRegs<F>::kRope; ++m) qr.rope[m] = ok ? __ldg(src + Fmt<F>::kNope / 2 + (t & 7) + 8 * m) : 0u;
}

// Logical k (S^T's permuted order: in k-steps 4J .. 4J + 3 quad column cc holds dims
// 64 J + 16 cc .. + 15 of the codes; in the RoPE k-steps, the 8-dim chunks cc and cc + 4) of
// NoPE dim d / RoPE dim r (even).
template <KVFormat F>
__device__ __forceinline__ int k_of_nope(int d) {
  const int l = d & 15;
  return 16 * (4 * (d >> 6) + (l >> 2)) + 8 * ((l >> 1) & 1) + 2 * ((d >> 4) & 3);
}
template <KVFormat F>
__device__ __forceinline__ int k_of_rope(int r) {
  const int cc = (r & 31) >> 3;
  const int l = (r & 7) + (r >= 32 ? 8 : 0);
  return 16 * (4 * (Fmt<F>::kNope / 64) + (l >> 2)) + 8 * ((l >> 1) & 1) + 2 * cc;
}

// Stores the fetched Q (heads h0 .. h0 + 15) into smem (`q_s`, H heads wide) and each head's
// 2^-k_h into qb_s[h].
template <KVFormat F, int H>
__device__ __forceinline__ void q_store(const QRegs<F>& qr, uint8_t* q_s, float* qb_s, int t, int h0) {
  const int h = h0 + (t >> 3);
  float mx = 0.f;
#pragma unroll
  for (int m = 0; m < QRegs<F>::kNope; ++m)
    mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(qr.nope[m] << 16)), fabsf(__uint_as_float(qr.nope[m] & 0xffff0000u))));
#pragma unroll
  for (int x = 1; x < 8; x *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
  const int e = static_cast<int>(__float_as_uint(mx) >> 23);  // mx >= 0
  const int k = (mx == 0.f || e >= 255) ? 0 : (e == 0 ? 125 : min(141 - e, 125));
  const float up = __uint_as_float(static_cast<uint32_t>(127 + k) << 23);
#pragma unroll
  for (int m = 0; m < QRegs<F>::kNope; ++m) {
    const int kk = k_of_nope<F>(2 * ((t & 7) + 8 * m));
    const uint32_t w = qr.nope[m];
    *reinterpret_cast<uint32_t*>(q_s + (kk >> 3) * H * 16 + h * 16 + (kk & 7) * 2) =
        pack_f16x2(__uint_as_float(w << 16) * up, __uint_as_float(w & 0xffff0000u) * up);
  }
#pragma unroll
  for (int m = 0; m < QRegs<F>::kRope; ++m) {
    const int kk = k_of_rope<F>(2 * ((t & 7) + 8 * m));
    *reinterpret_cast<uint32_t*>(q_s + (kk >> 3) * H * 16 + h * 16 + (kk & 7) * 2) = qr.rope[m];
  }
  if ((t & 7) == 0) qb_s[h] = __uint_as_float(static_cast<uint32_t>(127 - k) << 23);
}

// float(bf16(x)): the rule's rounding of a V32 scale.
__device__ __forceinline__ float bf16_round(float x) { return __uint_as_float(pack_bf16x2(x, 0.f) << 16); }

// Scale k of a token as the rule uses it: bf16(float32) (V32, one a word) or a UE8M0 byte
// (MODEL1, four a word: a power of two, looked up in the kScaleTable at smem address `table`),
// from the token's scale chunk in registers (`f`) or in smem (at address `at`).
template <KVFormat F>
__device__ __forceinline__ float tile_scale(const uint4& f, int k, uint32_t table) {
  const uint32_t w = word(f, F == KVFormat::kV32 ? k : k >> 2);
  if constexpr (F == KVFormat::kV32) {
    return bf16_round(__uint_as_float(w));
  } else {
    return lds_f32(table + 4 * ((w >> (8 * (k & 3))) & 0xffu));
  }
}
template <KVFormat F>
__device__ __forceinline__ float token_scale(uint32_t at, int k, uint32_t table) {
  if constexpr (F == KVFormat::kV32) {
    return bf16_round(lds_f32(at + 4 * k));
  } else {
    return lds_f32(table + 4 * lds_u8(at + k));
  }
}

// Warpgroup A: S^T = K Q^T for every block, the softmax, and P^T (f16) and the column factors
// alpha into buffer n % kPBufs for warpgroup B; at a piece's end the output factors and lse.
// kPBufs - 1 blocks ahead of B at most.
template <KVFormat F, int H>
__device__ __forceinline__ void consume_qk_f16(const Params& p, const Work& w, int s, uint32_t sb, uint8_t* smem) {
  static_assert(H == 16 || H == 32, "m64n16 or m64n32 products");
  using L = SmemRs<F, H>;
  using R = RawRow<F>;
  constexpr int kAcc = H / 2;
  constexpr int kCols = H / 4;
  constexpr int kJ = Fmt<F>::kDqk / 64;  // 16-dim chunks of an S^T row a quad column reads
  constexpr int kNopeJ = Fmt<F>::kNope / 64;
  constexpr int kTileJ = Fmt<F>::kSpansPerScale;  // chunks j per scale tile
  constexpr int kTiles = Fmt<F>::kScales;
  const int t = threadIdx.x;
  const int warp = t >> 5;
  const int lane = t & 31;
  const int c = lane & 3;
  const int g = lane >> 2;
  const int r0 = 16 * warp + g;  // S^T rows (tokens) r0, r0 + 8
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  float* qb_s = reinterpret_cast<float*>(smem + L::kQb);
  const float scale = p.scale_log2;

  Cursor cur;
  cursor_enter(cur, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  // 16 heads' Q is fetched a request ahead; 32 heads' (twice the registers) when it is stored.
  constexpr bool kQAhead = H == 16;
  QRegs<F> qr;
  if (kQAhead) q_fetch<F>(p, cur.r, s, t, 0, qr);
  bool q_pending = true;
  float qb[kCols];
  int pieces = 0;
  float m[kCols], l[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    m[j] = kInitMax;
    l[j] = 0.f;
  }

  int n = 0;
  for (;; ++n) {
    Cursor nx = cur;
    cursor_advance(nx, p, w.end_req, w.end_block);
    const bool last = nx.r != cur.r;
    const int stage = n % kRsStages;
    const uint32_t raw = sb + L::kRaw + stage * L::kRawTile;

    if (q_pending) {  // (the last request's products are done: every warp passed the softmax)
      if (kQAhead) {
        q_store<F, H>(qr, smem + L::kQ, qb_s, t, 0);
      } else {
        QRegs<F> qr2;
        q_fetch<F>(p, cur.r, s, t, 0, qr);
        q_fetch<F>(p, cur.r, s, t, 16, qr2);
        q_store<F, H>(qr, smem + L::kQ, qb_s, t, 0);
        q_store<F, H>(qr2, smem + L::kQ, qb_s, t, 16);
      }
      fence_proxy_async();
      named_bar_sync(kRsBarQ, kWarpgroup);
#pragma unroll
      for (int j = 0; j < kCols; ++j) qb[j] = qb_s[8 * (j / 2) + 2 * c + (j & 1)];
      q_pending = false;
    }
    mbar_wait(sb + L::kFull + 8 * stage, (n / kRsStages) & 1);
    const uint32_t vw = reinterpret_cast<const uint32_t*>(smem + L::kValid)[4 * stage + warp];
    const bool v0 = (vw >> g) & 1, v1 = (vw >> (g + 8)) & 1;

    const uint32_t row_a = raw + r0 * kRsPitch, row_b = row_a + 8 * kRsPitch;
    float sc_a[kTiles], sc_b[kTiles];
    {
      const uint4 fa = lds128(row_a + R::kScaleChunk * 16);
      const uint4 fb = lds128(row_b + R::kScaleChunk * 16);
#pragma unroll
      for (int k = 0; k < kTiles; ++k) {
        sc_a[k] = tile_scale<F>(fa, k, sb + L::kScaleTable);
        sc_b[k] = tile_scale<F>(fb, k, sb + L::kScaleTable);
      }
    }
    float acc[kTiles][kAcc], racc[kAcc];
#pragma unroll
    for (int k = 0; k < kTiles; ++k) zero(acc[k]);
    zero(racc);
    uint32_t a[2][16];
    const uint64_t dq = desc_k_major(sb + L::kQ, H);
    // The raw chunks of k-step group j: NoPE chunk 4 j + c of rows a, b (x[0], x[1]); RoPE
    // chunks kRopeChunk + c (k-steps 0, 1: x[0], x[1]) and + 4 (2, 3: x[2], x[3]). Group j + 1's
    // are loaded before group j converts, so that no conversion waits on its load.
    const auto load_group = [&](int j, uint4(&x)[4]) {
      if (j < kNopeJ) {
        x[0] = lds128(row_a + (4 * j + c) * 16);
        x[1] = lds128(row_b + (4 * j + c) * 16);
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          x[2 * half] = lds128(row_a + (R::kRopeChunk + c + 4 * half) * 16);
          x[2 * half + 1] = lds128(row_b + (R::kRopeChunk + c + 4 * half) * 16);
        }
      }
    };
    uint4 xg[2][4];
    load_group(0, xg[0]);
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      if (j + 1 < kJ) load_group(j + 1, xg[(j + 1) & 1]);
      if (j >= 2) wgmma_wait<1>();  // the group that used a[j & 1] is done
      uint32_t* aj = a[j & 1];
      const uint4(&x)[4] = xg[j & 1];
      if (j < kNopeJ) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          codes_f16(word(x[0], i), aj[4 * i + 0], aj[4 * i + 2]);
          codes_f16(word(x[1], i), aj[4 * i + 1], aj[4 * i + 3]);
        }
      } else {  // RoPE dims, bf16 as stored
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            aj[4 * (2 * half + i) + 0] = word(x[2 * half], 2 * i);
            aj[4 * (2 * half + i) + 2] = word(x[2 * half], 2 * i + 1);
            aj[4 * (2 * half + i) + 1] = word(x[2 * half + 1], 2 * i);
            aj[4 * (2 * half + i) + 3] = word(x[2 * half + 1], 2 * i + 1);
          }
      }
      if (j == kJ - 1) release_tile<1>(sb + L::kEmpty + 8 * stage, 0);  // A's loads of the stage are done
      if (j == 0) {
#pragma unroll
        for (int k = 0; k < kTiles; ++k) pin(acc[k]);
        pin(racc);
      }
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint64_t db = dq + static_cast<uint64_t>((4 * j + i) * 2 * H * 16 / 16);
        if (j < kNopeJ) {
          wgmma_m64nNk16_rs<true, H>(acc[j / kTileJ], aj + 4 * i, db);
        } else {
          wgmma_m64nNk16_rs<false, H>(racc, aj + 4 * i, db);
        }
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < kTiles; ++k) pin(acc[k]);
    pin(racc);
    if (last && nx.r <= w.end_req) {  // every QK of this request is done: fetch the next Q
      if (kQAhead) q_fetch<F>(p, nx.r, s, t, 0, qr);
      q_pending = true;
    }
    float sacc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const float* sc = ((i >> 1) & 1) ? sc_b : sc_a;
      float x = 0.f;
#pragma unroll
      for (int k = 0; k < kTiles; ++k) x = fmaf(sc[k], acc[k][i], x);
      sacc[i] = fmaf(x, qb[acc_column(i)], racc[i]);
    }

    // Softmax over the 64 tokens of each head (column).
    float alpha[kCols];
    block_softmax<H>(sacc, v0, v1, m, l, alpha, scale, red, warp, lane, kRsBarRed, kRsBarGrow);

    const int pb = p_buffer<L::kPBufs>(n);
    if (n >= L::kPBufs) named_bar_sync(kRsBarPFree + pb, 2 * kWarpgroup);  // B is done with block n - kPBufs's
    // P^T (f16) in O^T's token order: token 16 ks + 4 b + 8 h + cc is k = 16 ks + 8 h + 2 cc + b.
    uint8_t* p_s = smem + L::kP + pb * L::kPBytes;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int h = 8 * (i >> 2) + 2 * c + (i & 1);
      const int tok = r0 + 8 * ((i >> 1) & 1);
      const int rem = tok & 15;
      const int k = (tok & ~15) + 8 * (rem >> 3) + 2 * (rem & 3) + ((rem >> 2) & 1);
      *reinterpret_cast<uint16_t*>(p_s + (k >> 3) * H * 16 + h * 16 + (k & 7) * 2) =
          static_cast<uint16_t>(pack_f16x2(sacc[i], 0.f) & 0xffffu);
      if (!R::kV32)  // the same in bf16, for B's RoPE product
        *reinterpret_cast<uint16_t*>(p_s + (L::kPBf16 - L::kP) + (k >> 3) * H * 16 + h * 16 + (k & 7) * 2) =
            static_cast<uint16_t>(pack_bf16x2(sacc[i], 0.f) & 0xffffu);
    }
    float* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha) + pb * H;
    if (warp == 0 && g == 0) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) alpha_s[8 * (j / 2) + 2 * c + (j & 1)] = alpha[j];
    }
    if (last) {  // the piece's factors (1 / sum, the sink) for B, and its lse
      const PieceOut po = piece_out(p, w, cur.r);
      reduce_columns<H, false>(l, red, warp, lane, kRsBarRed);
      float* final_s = reinterpret_cast<float*>(smem + L::kFinal) + p_buffer<L::kPBufs>(pieces) * H;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int h = 8 * (j / 2) + 2 * c + (j & 1);
        const float f = finish_head(p, w, po, s, h, l[j], m[j], lane < 4 && warp == 0);
        if (warp == 0 && g == 0) final_s[h] = f;
        m[j] = kInitMax;
        l[j] = 0.f;
      }
      ++pieces;
    }
    fence_proxy_async();
    named_bar_arrive(kRsBarPReady + pb, 2 * kWarpgroup);
    if (nx.r > w.end_req) break;
    cur = nx;
  }
  // Pair B's last arrivals on P-free (blocks n - kPBufs + 1 .. n), so that no named barrier is
  // left half arrived.
#pragma unroll
  for (int k = L::kPBufs - 1; k >= 0; --k)
    if (n >= k) named_bar_sync(kRsBarPFree + p_buffer<L::kPBufs>(n - k), 2 * kWarpgroup);
}

// A fragments of O^T's m-tile mt from the 4 raw chunks `rv` (tokens bh = 0 .. 3 of a k-step):
// the codes of dims 2 mt, 2 mt + 1 as f16 pairs, (token 0, token 1) in x0 (dim 2 mt) and x1,
// (token 2, token 3) in x2, x3.
__device__ __forceinline__ void pv_codes(const uint4 (&rv)[4], int mt, uint32_t& x0, uint32_t& x1, uint32_t& x2,
                                         uint32_t& x3) {
  const int wi = mt >> 1;
  const uint32_t sel = (mt & 1) ? 0x7362u : 0x5140u;
  codes_f16(__byte_perm(word(rv[0], wi), word(rv[1], wi), sel), x0, x1);
  codes_f16(__byte_perm(word(rv[2], wi), word(rv[3], wi), sel), x2, x3);
}

// f16 pair x times (lo, hi) in fp32, rounded once to an f16 pair.
__device__ __forceinline__ uint32_t f16x2_mul_f32(uint32_t x, float lo, float hi) {
  float a, b;
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
      : "=f"(a), "=f"(b)
      : "r"(x));
  return pack_f16x2(a * lo, b * hi);
}

// bk[4 mt .. 4 mt + 3] (of kMt m-tiles) with a runtime mt (the exact path's loop is not
// unrolled: it is rare).
template <int kMt>
__device__ __forceinline__ void bk_set(uint32_t* bk, int mt, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
#pragma unroll
  for (int m = 0; m < kMt; ++m)
    if (m == mt) {
      bk[4 * m + 0] = a0;
      bk[4 * m + 1] = a1;
      bk[4 * m + 2] = a2;
      bk[4 * m + 3] = a3;
    }
}

// Warpgroup B: O^T = alpha O^T + V^T P^T for every block in f16 (A: the codes of value dims
// 16 q .. 16 q + 15 of the thread's tokens times scale / c), the output at a piece's end.
template <KVFormat F, int H>
__device__ __forceinline__ void consume_pv_f16(const Params& p, const Work& w, int s, uint32_t sb, uint8_t* smem) {
  using L = SmemRs<F, H>;
  using R = RawRow<F>;
  constexpr int kAcc = H / 2;
  constexpr int kCols = H / 4;
  const int t = threadIdx.x - kWarpgroup;
  const int warp = t >> 5;
  const int lane = t & 31;
  const int c = lane & 3;
  const int g = lane >> 2;
  const int q = 8 * warp + g;  // O^T rows: value dims 16 q .. 16 q + 15, scale tile `tile`
  // MODEL1's codes end at dim 448: threads q >= 28 (warp 3, g >= 4) convert RoPE bytes as if
  // they were codes. A product's row depends only on the same row of A, so that garbage stays
  // in their own O^T rows, which are never stored: the RoPE dims come from a bf16 m-tile
  // (kRopeTile) whose row 16 warp + g is RoPE dim 16 warp + 2 g and row + 8 the next dim.
  constexpr bool kRopeTile = !R::kV32;
  const bool code_rows = !kRopeTile || 16 * q < Fmt<F>::kNope;
  const int tile = (kRopeTile ? min(16 * q, Fmt<F>::kNope - 1) : 16 * q) / (Fmt<F>::kSpansPerScale * 64);
  const uint32_t rope_at = R::kRopeChunk * 16 + 2 * (16 * warp + 2 * g);  // (kRopeTile) in a row
  constexpr float kCMin = 1.17549435e-38f;  // 2^-126: c before any scale

  Cursor cur;
  cursor_enter(cur, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  bool first = true;
  int pieces = 0;
  float cn = kCMin;   // this thread's normalizer (the same across its quad)
  float piece_max = 0.f;  // the piece's largest scale so far in this thread's scale tile
  // MODEL1 and 32 heads: a piece's first block overwrites O^T (its first k-step's products
  // ignore the old values) and the piece's output slot is read then: 2% off MODEL1's 16-head
  // time, 1% off V32's 32 (no zeroing moves). V32 at 16 heads zeroes O^T after each piece's
  // output and reads the slot there: overwriting cost it 3% (benchmarks/NOTES.md, sessions
  // 24-25).
  constexpr bool kFirstBlockOverwrites = kRopeTile || H == 32;
  // MODEL1 writes B's products out twice, for the fast and the exact A values: one branch a
  // block rather than two jumps a group. V32's 16-head kernel ran 3% slower so (session 27); it
  // branches a group at run time.
  constexpr bool kProductsTwice = F == KVFormat::kModel1;
  float o[8 * kAcc];  // O^T / cn: m-tile mt (dims 16 q + 2 mt, + 1) at o[mt * kAcc ..]
  float orope[kRopeTile ? kAcc : 1];  // (kRopeTile) the RoPE dims' O^T, not in units of cn
  if constexpr (!kFirstBlockOverwrites) {
    zero(o);
    zero(orope);
  }
  PieceOut po;

  for (int n = 0;; ++n) {
    Cursor nx = cur;
    cursor_advance(nx, p, w.end_req, w.end_block);
    const bool last = nx.r != cur.r;
    const int stage = n % kRsStages;
    const uint32_t raw = sb + L::kRaw + stage * L::kRawTile;
    const int pb = p_buffer<L::kPBufs>(n);
    if (kFirstBlockOverwrites && first) po = piece_out(p, w, cur.r);

    mbar_wait(sb + L::kFull + 8 * stage, (n / kRsStages) & 1);
    // The 4 raw chunks (dims 16 q .. + 15) of k-step ks's tokens bh = 0 .. 3; each k-step's are
    // loaded one k-step ahead (the first before A's P^T is waited for), so that no conversion
    // waits on its load.
    const auto token = [&](int ks, int bh) { return 16 * ks + 4 * (bh & 1) + 8 * (bh >> 1) + c; };
    const auto load_rows = [&](int ks, uint4(&rv)[4]) {
#pragma unroll
      for (int bh = 0; bh < 4; ++bh) rv[bh] = lds128(raw + token(ks, bh) * kRsPitch + q * 16);
    };
    uint4 rvs[2][4];
    load_rows(0, rvs[0]);
    // The scales of the thread's 16 tokens (k-step ks: tokens 16 ks + 4 b + 8 h + c, bh = b + 2 h).
    float sv[16];
    float smax = 0.f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int bh = 0; bh < 4; ++bh) {
        sv[4 * ks + bh] = token_scale<F>(raw + token(ks, bh) * kRsPitch + R::kScaleChunk * 16, tile, sb + L::kScaleTable);
        smax = fmaxf(smax, fabsf(sv[4 * ks + bh]));
      }
    smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 1));
    smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 2));
    // c follows each block's largest scale, up and down: a running maximum would flush the
    // codes of later small-scale blocks to zero in f16. It stays within 2^40 of the piece's
    // largest scale so that O^T (in units of c) cannot overflow.
    smax = fminf(smax, 3.0e38f);
    piece_max = fmaxf(piece_max, smax);
    const float c_new = pow2_ceil(fmaxf(smax, piece_max * 0x1p-40f));
    const float inv_c = pow2_reciprocal(c_new);
    const float ratio = cn * inv_c;  // old / new normalizer: a power of two (rounded as cn / c_new)
    cn = c_new;
    // f16(scale / c) is exact down to f16's smallest normal; a warp with a smaller ratio (a
    // block whose scales span more than 2^14: never with a quantizer's) multiplies in fp32,
    // so that each A value is rounded once, as on the fast path. Below 2^-34 a ratio times any
    // code (|code| <= 448) is under 2^-25 and both paths round the product to zero: such tokens
    // (scale 0; MODEL1's invalid rows, whose zero scale bytes read 2^-127) keep the fast path.
    bool tiny = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float ratio_i = fabsf(sv[i] * inv_c);
      tiny |= ratio_i < 0x1p-14f && ratio_i >= 0x1p-34f;
    }
    // A warp's vote suffices where the two paths share their wgmma instructions. With the
    // products written twice all four warps must issue the same wgmma: the warpgroup votes (the
    // exact path gives the fast path's values wherever that one is exact).
    const bool exact_a = kProductsTwice ? named_bar_any(kRsBarExact, kWarpgroup, tiny)
                                        : __any_sync(0xffffffffu, tiny);
    // The fast path's f16 factors scale / c, two tokens a register (sv is dead after this: the
    // exact path reloads the scales).
    uint32_t scp[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) scp[i] = pack_f16x2(sv[2 * i] * inv_c, sv[2 * i + 1] * inv_c);
    const auto scale_over_c = [&](int ks, int bh) {
      return token_scale<F>(raw + token(ks, bh) * kRsPitch + R::kScaleChunk * 16, tile, sb + L::kScaleTable) * inv_c;
    };
    // (kRopeTile) the RoPE m-tile's A fragments, bf16 as stored: k-step ks's tokens bh = 0 .. 3
    // are the same as the codes' (k = 2 c, 2 c + 1, 2 c + 8, 2 c + 9); one 4-byte load gives a
    // token's two dims (rows g, g + 8).
    uint32_t ra[kRopeTile ? 16 : 1];
    if constexpr (kRopeTile) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t v[4];
#pragma unroll
        for (int bh = 0; bh < 4; ++bh)
          v[bh] = __float_as_uint(lds_f32(raw + token(ks, bh) * kRsPitch + rope_at));
        ra[4 * ks + 0] = __byte_perm(v[0], v[1], 0x5410);
        ra[4 * ks + 1] = __byte_perm(v[0], v[1], 0x7632);
        ra[4 * ks + 2] = __byte_perm(v[2], v[3], 0x5410);
        ra[4 * ks + 3] = __byte_perm(v[2], v[3], 0x7632);
      }
    }

    named_bar_sync(kRsBarPReady + pb, 2 * kWarpgroup);
    const float* alpha_s = reinterpret_cast<const float*>(smem + L::kAlpha) + pb * H;
    float alpha[kCols], f[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) alpha[j] = alpha_s[8 * (j / 2) + 2 * c + (j & 1)] * ratio;
    if (kRopeTile && !first) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) orope[i] *= alpha_s[8 * (i >> 2) + 2 * c + (i & 1)];
    }
    if (last) {
      const float* final_s = reinterpret_cast<const float*>(smem + L::kFinal) + p_buffer<L::kPBufs>(pieces) * H;
#pragma unroll
      for (int j = 0; j < kCols; ++j) f[j] = final_s[8 * (j / 2) + 2 * c + (j & 1)];
    }
    if (!first && __any_sync(0xffffffffu, [&] {
          bool any = false;
#pragma unroll
          for (int j = 0; j < kCols; ++j) any |= alpha[j] != 1.f;
          return any;
        }())) {
#pragma unroll
      for (int i = 0; i < 8 * kAcc; ++i) o[i] *= alpha[acc_column(i % kAcc)];
    }

    const uint64_t dp_ = desc_k_major(sb + L::kP + pb * L::kPBytes, H);
    if constexpr (kRopeTile) {  // the RoPE m-tile, all four k-steps, in a commit group ahead of the codes'
      const uint64_t dpb = desc_k_major(sb + L::kPBf16 + pb * L::kPBytes, H);
      pin(orope);
      pin(ra);  // (computed before the fence)
      wgmma_fence();
#pragma unroll
      for (int k4 = 0; k4 < 4; ++k4)
        wgmma_m64nNk16_rs_or_overwrite<false, H>(orope, ra + 4 * k4,
                                                 dpb + static_cast<uint64_t>(k4 * 2 * H * 16 / 16), !first || k4 > 0);
      wgmma_commit();
    }
    // Each k-step's 8 m-tiles go to the tensor cores in kGroups commit groups of kMtG; a group's
    // A fragments are double-buffered (at 32 heads a whole k-step's would cost 64 registers).
    constexpr int kGroups = H == 16 ? 1 : 2;
    constexpr int kMtG = 8 / kGroups;
    uint32_t b[2][4 * kMtG];
    // `exact`: a std::bool_constant where the products are written twice, else a bool.
    const auto products = [&](auto exact) {
      constexpr bool kWrittenTwice = !std::is_same_v<decltype(exact), bool>;
#pragma unroll
      for (int gn = 0; gn < 4 * kGroups; ++gn) {  // group gn: k-step ks, m-tiles m0 ..
        const int ks = gn / kGroups;
        const int m0 = gn % kGroups * kMtG;
        if (m0 == 0 && ks + 1 < 4) load_rows(ks + 1, rvs[(ks + 1) & 1]);
        const uint4(&rv)[4] = rvs[ks & 1];
        if (gn >= 2) wgmma_wait<1>();  // the group that used b[gn & 1] is done
        uint32_t* bk = b[gn & 1];
        if (!exact) {
          const uint32_t sc01 = scp[2 * ks], sc23 = scp[2 * ks + 1];  // tokens (0, 1) in x0, x1; (2, 3) in x2, x3
#pragma unroll
          for (int mi = 0; mi < kMtG; ++mi) {
            uint32_t x0, x1, x2, x3;
            pv_codes(rv, m0 + mi, x0, x1, x2, x3);
            bk[4 * mi + 0] = f16x2_mul(x0, sc01);
            bk[4 * mi + 1] = f16x2_mul(x1, sc01);
            bk[4 * mi + 2] = f16x2_mul(x2, sc23);
            bk[4 * mi + 3] = f16x2_mul(x3, sc23);
          }
        } else {
          const float r0 = scale_over_c(ks, 0), r1 = scale_over_c(ks, 1), r2 = scale_over_c(ks, 2),
                      r3 = scale_over_c(ks, 3);
          if constexpr (kWrittenTwice) {  // (a runtime m-tile index in bk_set would spill here)
#pragma unroll
            for (int mi = 0; mi < kMtG; ++mi) {
              uint32_t x0, x1, x2, x3;
              pv_codes(rv, m0 + mi, x0, x1, x2, x3);
              bk[4 * mi + 0] = f16x2_mul_f32(x0, r0, r1);
              bk[4 * mi + 1] = f16x2_mul_f32(x1, r0, r1);
              bk[4 * mi + 2] = f16x2_mul_f32(x2, r2, r3);
              bk[4 * mi + 3] = f16x2_mul_f32(x3, r2, r3);
            }
          } else {
#pragma unroll 1
            for (int mi = 0; mi < kMtG; ++mi) {
              uint32_t x0, x1, x2, x3;
              pv_codes(rv, m0 + mi, x0, x1, x2, x3);
              bk_set<kMtG>(bk, mi, f16x2_mul_f32(x0, r0, r1), f16x2_mul_f32(x1, r0, r1), f16x2_mul_f32(x2, r2, r3),
                           f16x2_mul_f32(x3, r2, r3));
            }
          }
        }
        if (gn == 4 * kGroups - 1) release_tile<1>(sb + L::kEmpty + 8 * stage, 0);  // B's loads are done
        if (gn == 0) pin(o);
        wgmma_fence();
#pragma unroll
        for (int mi = 0; mi < kMtG; ++mi) {
          const uint64_t db = dp_ + static_cast<uint64_t>(ks * 2 * H * 16 / 16);
          if constexpr (kFirstBlockOverwrites) {  // (V32 keeps the immediate scale-d: a register one moved its schedule)
            wgmma_m64nNk16_rs_or_overwrite<true, H>(o + (m0 + mi) * kAcc, bk + 4 * mi, db, !first || ks > 0);
          } else {
            wgmma_m64nNk16_rs<true, H>(o + (m0 + mi) * kAcc, bk + 4 * mi, db);
          }
        }
        wgmma_commit();
      }
      wgmma_wait<0>();  // (in each copy: no product in flight where the two join)
    };
    if constexpr (kProductsTwice) {
      if (exact_a) {
        products(std::true_type{});
      } else {
        products(std::false_type{});
      }
    } else {
      products(exact_a);
    }
    pin(o);
    pin(orope);
    named_bar_arrive(kRsBarPFree + pb, 2 * kWarpgroup);

    if (last) {  // the piece's output: O^T times cn and A's factors
      if constexpr (!kFirstBlockOverwrites) po = piece_out(p, w, cur.r);
      ++pieces;
      if (po.write) {
        // Head 8 (j / 2) + 2 c + j % 2: this thread's 16 dims 16 q .. + 15, dim 2 mt + hf
        // from o[mt * kAcc + 4 (j / 2) + 2 hf + j % 2].
        const int64_t row0 = (po.pieces == 1 ? static_cast<int64_t>(po.r) * p.s_q : po.slot * p.s_q) + s;
        const int d0 = 16 * q;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int h = 8 * (j / 2) + 2 * c + (j & 1);
          if (h >= p.h_q) continue;
          if constexpr (kRopeTile) {  // RoPE dims 16 warp + 2 g, + 1
            const float r0v = orope[4 * (j / 2) + (j & 1)] * f[j], r1v = orope[4 * (j / 2) + 2 + (j & 1)] * f[j];
            const int64_t er = (row0 * p.h_q + h) * kDimV + Fmt<F>::kNope + 16 * warp + 2 * g;
            if (po.pieces == 1) {
              *reinterpret_cast<uint32_t*>(p.out + er) = pack_bf16x2(r0v, r1v);
            } else {
              *reinterpret_cast<float2*>(p.out_accum + er) = make_float2(r0v, r1v);
            }
          }
          if (!code_rows) continue;
          const float fj = f[j] * cn;
          float v[16];
#pragma unroll
          for (int k = 0; k < 16; ++k) v[k] = o[(k >> 1) * kAcc + 4 * (j / 2) + 2 * (k & 1) + (j & 1)] * fj;
          const int64_t e0 = (row0 * p.h_q + h) * kDimV + d0;
          if (po.pieces == 1) {
            uint4* dst = reinterpret_cast<uint4*>(p.out + e0);
            dst[0] = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                                pack_bf16x2(v[6], v[7]));
            dst[1] = make_uint4(pack_bf16x2(v[8], v[9]), pack_bf16x2(v[10], v[11]), pack_bf16x2(v[12], v[13]),
                                pack_bf16x2(v[14], v[15]));
          } else {
            float4* dst = reinterpret_cast<float4*>(p.out_accum + e0);
#pragma unroll
            for (int k = 0; k < 4; ++k) dst[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
          }
        }
      }
      if constexpr (!kFirstBlockOverwrites) {
        zero(o);
        zero(orope);
      }
      cn = kCMin;
      piece_max = 0.f;
    }
    first = last;
    if (nx.r > w.end_req) break;
    cur = nx;
  }
}

template <KVFormat F, int H, bool kAligned>
__global__ void __launch_bounds__(kRsThreads, 1) decode_kernel_rs(const Params p) {
  using L = SmemRs<F, H>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int s = blockIdx.y;
  const Work w = read_work(p, blockIdx.x);
  if (w.begin_req > w.end_req) return;
  const uint32_t sb = smem_u32(smem);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kRsStages; ++i) {
      mbar_init(sb + L::kFull + 8 * i, kRsFullArrivals<F, kAligned>);
      mbar_init(sb + L::kEmpty + 8 * i, 2 * kWarpgroup / 32);  // A's and B's warps
    }
  }
  if constexpr (F == KVFormat::kModel1) {
    static_assert(kRsThreads >= 256, "a thread an entry of the scale table");
    if (threadIdx.x < 256) reinterpret_cast<float*>(smem + L::kScaleTable)[threadIdx.x] = ue8m0_to_float(threadIdx.x);
  }
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroup, 0);
  if (wg == 2) {
    setmaxnreg_dec<RsRegs<F, H>::kProducer>();
    produce_rs<F, H, kAligned>(p, w, s, sb, smem, threadIdx.x - 2 * kWarpgroup);
  } else if (wg == 1) {
    setmaxnreg_inc<RsRegs<F, H>::kPV>();
    consume_pv_f16<F, H>(p, w, s, sb, smem);
  } else {
    setmaxnreg_inc<RsRegs<F, H>::kQK>();
    consume_qk_f16<F, H>(p, w, s, sb, smem);
  }
}

}  // namespace cuda
}  // namespace jsm

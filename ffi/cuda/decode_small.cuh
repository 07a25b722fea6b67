// The decode kernel for few heads (h_q <= kSmallHeads = 16: a tensor-parallel shard of 8) of
// MODEL1 caches (V32 runs decode_small_rs.cuh's, which builds on the pieces here).
// The 64-row kernel pads them to 64 heads and spends its time dequantizing with one
// producer warpgroup; here both products are transposed so that the tokens and the value
// dimensions take wgmma's M and the H = 16 heads its N:
//   S^T = K Q^T   (64 tokens x H: A = the K tile as stored, B = Q)
//   O^T = V^T P^T (8 tiles of 64 value dims x H: A = the K tile read M-major, B = P^T)
// One consumer warpgroup holds O^T (4 H floats a thread) and does the softmax over M
// (each head's maximum crosses the four warps through smem); two producer warpgroups
// (produce_solo, one entry a thread) dequantize the 64 entries of a block.
// CTA: 384 threads, one per (worker, query row). Everything else as decode_kernel.cuh.
#pragma once

#include "cuda/decode_kernel.cuh"

namespace jsm {
namespace cuda {

// The head count it is built for: 32 (m64n32 products, 128 O^T floats a thread) compiled
// with 1.5 KB of spills and ran slower than the 64-row kernel (benchmarks/NOTES.md, session 6).
constexpr int kSmallHeads = 16;
constexpr int kSmallProducers = 2;  // producer warpgroups
constexpr int kSmallThreads = kWarpgroup * (1 + kSmallProducers);
// Registers after reallocation (the launch gives 168; 232 + 2 * 136 = 504).
constexpr int kSmallRegsConsumer = 232;
constexpr int kSmallRegsProducer = 136;
// Named barriers of the consumer warpgroup.
constexpr int kSmallBarQ = 1;    // its Q copies have landed
constexpr int kSmallBarRed = 2;  // the per-warp column maxima (or sums) are in smem
constexpr int kSmallBarP = 3;    // P^T is complete

// Shared memory: Q (H rows), the two K tiles (64 token rows, as in Smem), P^T (H rows of
// 64 entries), per-warp column reductions, valid words and the barriers. The interleaved
// operand layout of wgmma.cuh throughout.
template <KVFormat F, int H>
struct SmemSmall {
  static constexpr int kGroupStride = kRows * 16;  // K tiles
  static constexpr int kTile = Fmt<F>::kDqk * kRows * 2;
  static constexpr int kQ = 0;
  static constexpr int kK = (Fmt<F>::kDqk * H * 2 + 127) / 128 * 128;  // two buffers
  static constexpr int kP = kK + 2 * kTile;
  static constexpr int kRed = kP + kTokens * H * 2;  // 4 warps x H floats
  static constexpr int kValid = kRed + 4 * H * 4;    // 2 x 8 words
  static constexpr int kFull = kValid + 2 * 8 * 4;
  static constexpr int kEmpty = kFull + 2 * 8;
  static constexpr int kBytes = kEmpty + 2 * 8;
  static_assert(kBytes <= 232448, "shared memory over the sm_90 per-block limit");
  static_assert(kValid % 16 == 0 && kP % 16 == 0, "alignment");
};

// The per-head reduction over the 64 tokens: `v` holds this thread's value of each of its
// H/4 columns (heads 8 (j / 2) + 2 c + j % 2) over its two token rows; the result is the
// reduction over all 64 rows, for the same columns. Lanes of one c share columns.
template <int H, bool kMax>
__device__ __forceinline__ void reduce_columns(float (&v)[H / 4], float* red, int warp, int lane,
                                               int bar = kSmallBarRed) {
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
// entries are valid when v0 / v1): invalid rows get -inf, each head's maximum crosses the 64
// rows (smem `red`, named barrier `bar`), the running maximum m moves lazily (alpha: the
// factor of what came before), and sacc becomes probabilities 2^(scale s - m), added to this
// thread's share of l (its two rows; the 64 are summed at the piece's end).
template <int H>
__device__ __forceinline__ void block_softmax(float (&sacc)[H / 2], bool v0, bool v1, float (&m)[H / 4],
                                              float (&l)[H / 4], float (&alpha)[H / 4], float scale, float* red,
                                              int warp, int lane, int bar) {
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
  reduce_columns<H, true>(mx, red, warp, lane, bar);
#pragma unroll
  for (int j = 0; j < H / 4; ++j) {
    const float mx_scaled = mx[j] * scale;  // scale > 0
    const bool grow = mx_scaled > m[j] + kLazyRescale;
    const float m_new = grow ? mx_scaled : m[j];
    alpha[j] = grow ? fast_exp2(m[j] - m_new) : 1.f;
    m[j] = m_new;
    l[j] *= alpha[j];
  }
#pragma unroll
  for (int i = 0; i < H / 2; ++i) {
    const int j = acc_column(i);
    sacc[i] = fast_exp2(fmaf(sacc[i], scale, -m[j]));
    l[j] += sacc[i];
  }
}

// Writes this thread's part of O^T (scaled by f per column) to the rows of heads
// 2 c + 8 (i / 4) + i % 2 < 2 c + heads_left of `dst` (kDimV apart); `dst` points at the
// element (head 2 c, value dim r0).
template <int H, typename T, typename Cast>
__device__ __forceinline__ void store_out_t(T* dst, const float* o, const float* f, int heads_left, Cast cast) {
#pragma unroll
  for (int i = 0; i < H / 2; ++i) {
    const int dh = 8 * (i >> 2) + (i & 1);
    if (dh >= heads_left) continue;
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
      dst[dh * kDimV + 64 * mt + 8 * ((i >> 1) & 1)] = cast(o[mt * (H / 2) + i] * f[acc_column(i)]);
  }
}

template <KVFormat F, int H>
__device__ __forceinline__ void consume_small(const Params& p, const Work& w, int s, uint32_t sb, uint8_t* smem) {
  static_assert(H == 16, "the products below are m64n16");
  using L = SmemSmall<F, H>;
  constexpr int kAcc = H / 2;   // accumulators of one 64 x H product
  constexpr int kCols = H / 4;  // the thread's columns (heads)
  const int t = threadIdx.x;
  const int warp = t >> 5;
  const int lane = t & 31;
  const int c = lane & 3;
  const int r0 = 16 * warp + (lane >> 2);  // this thread's token rows: r0, r0 + 8
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  uint8_t* p_s = smem + L::kP;
  const float scale = p.scale_log2;

  Cursor cur;
  cursor_enter(cur, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  load_q<F, H>(p, cur.r, s, 0, sb + L::kQ, t);
  bool q_pending = true;
  bool first = true;
  float o[8 * kAcc];  // O^T: tile m (value dims 64 m ..) at o[m * kAcc ..]
  zero(o);
  float m[kCols], l[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    m[j] = kInitMax;
    l[j] = 0.f;
  }

  for (int n = 0;; ++n) {
    const ConsumerStep st = consumer_step<F, L>(p, w, cur, n, sb);
    const Cursor& nx = st.next;
    const bool last = st.last;
    const int buf = st.buf;
    const uint32_t k_s = st.k_tile;

    if (q_pending) {
      await_q(kSmallBarQ);
      q_pending = false;
    }
    long long span_t = span_clock();
    wait_full(sb + L::kFull + 8 * buf, (n >> 1) & 1);
    span_add(t == 0, kSpanQKWaitTile, span_t);
    // The block's validity bits, read before QK so that their load (behind the tile writes
    // in the shared-memory queue) overlaps the product rather than starting the softmax.
    const uint64_t valid = block_valid_mask(smem + L::kValid + 32 * buf);
    span_t = span_clock();

    // S^T = K Q^T
    float sacc[kAcc];
    zero(sacc);
    if (!kSkipMma) {
      pin(sacc);
      wgmma_fence();
      const uint64_t dk = desc_k_major(k_s, kTokens);
      const uint64_t dq = desc_k_major(sb + L::kQ, H);
#pragma unroll
      for (int ks = 0; ks < Fmt<F>::kDqk / 16; ++ks)
        wgmma_m64n16k16_ss<kKMajor>(sacc, dk + static_cast<uint64_t>(ks * 2 * L::kGroupStride / 16),
                                    dq + static_cast<uint64_t>(ks * 2 * H * 16 / 16));
      wgmma_commit();
      wgmma_wait<0>();
      pin(sacc);
    }
    span_add(t == 0, kSpanQK, span_t);
    span_t = span_clock();
    if (last && nx.r <= w.end_req) {  // every QK of this request is done: fetch the next Q
      load_q<F, H>(p, nx.r, s, 0, sb + L::kQ, t);
      q_pending = true;
    }

    // Softmax over the 64 tokens of each head (column).
    float alpha[kCols];
    block_softmax<H>(sacc, (valid >> r0) & 1, (valid >> (r0 + 8)) & 1, m, l, alpha, scale, red, warp, lane,
                     kSmallBarRed);
    span_add(t == 0, kSpanSoftmaxMath, span_t);
    const long long span_out = span_clock();

    // P^T (bf16) as the K-major B operand: element (head h, token k) at
    // (k / 8) * H * 16 + h * 16 + (k % 8) * 2.
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int h = 8 * (i >> 2) + 2 * c + (i & 1);
      const int k = r0 + 8 * ((i >> 1) & 1);
      *reinterpret_cast<uint16_t*>(p_s + (k >> 3) * H * 16 + h * 16 + (k & 7) * 2) =
          static_cast<uint16_t>(pack_bf16x2(sacc[i], 0.f) & 0xffffu);
    }
    fence_proxy_async();
    named_bar_sync(kSmallBarP, kWarpgroup);
    span_add(t == 0, kSpanSoftmaxHandOver, span_out);
    span_add(t == 0, kSpanSoftmax, span_t);
    span_t = span_clock();

    // O^T = alpha O^T + V^T P^T, 8 tiles of 64 value dims.
    if (!first && __any_sync(0xffffffffu, [&] {
          bool any = false;
#pragma unroll
          for (int j = 0; j < kCols; ++j) any |= alpha[j] != 1.f;
          return any;
        }())) {
#pragma unroll
      for (int i = 0; i < 8 * kAcc; ++i) o[i] *= alpha[acc_column(i % kAcc)];
    }
    if (!kSkipMma) {
      const uint64_t dp_ = desc_k_major(sb + L::kP, H);
      pin(o);
      wgmma_fence();
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        const uint64_t dv = desc_n_major(k_s + mt * 8 * L::kGroupStride, kTokens);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          wgmma_m64n16k16_ss<kNMajor>(o + mt * kAcc, dv + static_cast<uint64_t>(ks * 16),
                                      dp_ + static_cast<uint64_t>(ks * 2 * H * 16 / 16));
      }
      wgmma_commit();
      wgmma_wait<0>();
      pin(o);
    }
    span_add(t == 0, kSpanQKPV, span_t);
    release_tile<1>(sb + L::kEmpty + 8 * buf, 0);

    first = last;
    if (last) {  // the piece's output: O^T / sum (with the sink), lse
      span_t = span_clock();
      const PieceOut po = piece_out(p, w, cur.r);
      reduce_columns<H, false>(l, red, warp, lane);
      float f[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        f[j] = finish_head(p, w, po, s, 8 * (j / 2) + 2 * c + (j & 1), l[j], m[j], lane < 4 && warp == 0);
        m[j] = kInitMax;
        l[j] = 0.f;
      }
      if (po.write) {
        // Element i of tile mt goes to head 8 (i / 4) + 2 c + i % 2, value dim
        // 64 mt + r0 + 8 ((i / 2) % 2): constant offsets from this thread's first one.
        const int64_t row0 = (po.pieces == 1 ? static_cast<int64_t>(po.r) * p.s_q : po.slot * p.s_q) + s;
        const int64_t first_elem = (row0 * p.h_q + 2 * c) * kDimV + r0;
        if (po.pieces == 1) {
          store_out_t<H>(p.out + first_elem, o, f, p.h_q - 2 * c, [](float v) {
            return static_cast<uint16_t>(pack_bf16x2(v, 0.f) & 0xffffu);
          });
        } else {
          store_out_t<H>(p.out_accum + first_elem, o, f, p.h_q - 2 * c, [](float v) { return v; });
        }
      }
      zero(o);
      span_add(t == 0, kSpanQKPieceEnd, span_t);
    }
    if (nx.r > w.end_req) break;
    cur = nx;
  }
}

template <KVFormat F, int H, bool kAligned>
__global__ void __launch_bounds__(kSmallThreads, 1) decode_kernel_small(const Params p) {
  using L = SmemSmall<F, H>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int worker = blockIdx.x;
  const int s = blockIdx.y;
  stamp(threadIdx.x == 0, kStampEntry);
  const Work w = read_work(p, worker);
  if (w.begin_req > w.end_req) return;
  stamp(threadIdx.x == 0, kStampWork);

  const uint32_t sb = smem_u32(smem);
  init_tile_barriers(sb + L::kFull, sb + L::kEmpty, kProducers * kSmallProducers, kWarpgroup / 32);
  __syncthreads();
  stamp(threadIdx.x == 0, kStampInit);

  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroup, 0);
  if (wg >= 1) {
    setmaxnreg_dec<kSmallRegsProducer>();
    produce_solo<F, kAligned, 1, L>(p, w, s, sb, smem, wg - 1, threadIdx.x - kWarpgroup * wg);
  } else {
    setmaxnreg_inc<kSmallRegsConsumer>();
    consume_small<F, H>(p, w, s, sb, smem);
    stamp(threadIdx.x == 0, kStampExit);  // (the consumer finishes last: it waits on every tile)
  }
}

}  // namespace cuda
}  // namespace jsm

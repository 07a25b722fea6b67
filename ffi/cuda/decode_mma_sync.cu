// The first CUDA decode kernel (mma.sync, no warp specialization); kept while the
// wgmma kernel (decode_wgmma.cu) is measured against it. JSM_DECODE_KERNEL=mma_sync selects it.
//
// One CTA of 256 threads (8 warps) per (worker, query row, group of 64 heads). A CTA
// walks its worker's blocks of 64 list entries (SPEC §6) and, for each block:
//   1. waits for the block's raw cache bytes (gathered by cp.async one block ahead),
//   2. dequantizes them to bf16 in shared memory (exact SPEC §2 rule, bit tricks),
//   3. issues the gather of the next block and loads the indices of the one after,
//   4. S = Q K^T with mma.sync m16n8k16 (warps: 2 row halves x 2 token halves x
//      2 halves of the head dim; the two dim halves are summed through smem),
//   5. online softmax in base 2 (256 threads, 4 per head row), P rounded to bf16,
//   6. O = alpha O + P V (each warp owns 64 value columns of all 64 rows),
//   7. at the end of a request's piece, writes out/lse (one piece) or the fp32
//      partials for the combine pass (several pieces).
// Invalid entries are never read: their copies are zero-filled (src-size 0), which
// dequantizes to exact zeros, and their logits are masked to -inf.
#include "cuda/decode_common.cuh"

namespace jsm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSredStride = 72;    // floats per row of the S reduction buffer
constexpr int kPStride = 144;      // bytes per row of P (64 bf16 + 16 pad)

template <KVFormat F>
struct Fmt;

template <>
struct Fmt<KVFormat::kV32> {
  static constexpr int kDqk = 576;
  static constexpr int kRowBytes = 1168;  // bf16 row stride of Q and K tiles: 73 x 16 B (odd: no ldmatrix conflicts)
  static constexpr int kRawStride = 656;  // staging bytes per token (the token's bytes as stored)
  static constexpr int kTokenBytes = 656;
};

template <>
struct Fmt<KVFormat::kModel1> {
  static constexpr int kDqk = 512;
  static constexpr int kRowBytes = 1040;  // 65 x 16 B
  static constexpr int kRawStride = 592;  // 576 data bytes + 8 scale bytes + 8 pad
  static constexpr int kTokenBytes = 584;
};

template <KVFormat F>
struct Smem {
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRows * Fmt<F>::kRowBytes;
  static constexpr int kRaw = kK + kTokens * Fmt<F>::kRowBytes;
  static constexpr int kSred = kRaw + kTokens * Fmt<F>::kRawStride;
  static constexpr int kP = kSred + kRows * kSredStride * 4;
  static constexpr int kValid = kP + kRows * kPStride;  // 2 x 64 floats (1 valid, 0 not)
  static constexpr int kAlpha = kValid + 2 * kTokens * 4;
  static constexpr int kM = kAlpha + kRows * 4;
  static constexpr int kL = kM + kRows * 4;
  static constexpr int kBytes = kL + kRows * 4;
};

__device__ __forceinline__ const uint8_t* shfl_ptr(const uint8_t* ptr, int src_lane) {
  return reinterpret_cast<const uint8_t*>(
      __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(ptr), src_lane));
}

// Gathers the 64 tokens of a block into the staging rows, coalesced: warp w copies
// tokens w, w+8, ..., w+56, one token row per instruction (consecutive lanes take
// consecutive 16-byte chunks, so a warp reads whole cache lines). Lane k < 8 holds the
// TokenRef of token w + 8k (see fetch_token). Invalid tokens: zero-filled rows, nothing read.
template <KVFormat F>
__device__ __forceinline__ void issue_gather(const TokenRef& mine, uint32_t raw_s, float* valid_row, int warp,
                                             int lane) {
#pragma unroll 2
  for (int k = 0; k < 8; ++k) {
    const uint8_t* data = shfl_ptr(mine.data, k);
    const int valid = __shfl_sync(0xffffffffu, mine.valid, k);
    const int a16 = __shfl_sync(0xffffffffu, mine.a16, k);
    const uint32_t dst = raw_s + (warp + 8 * k) * Fmt<F>::kRawStride;
    const uint32_t n16 = valid ? 16u : 0u;
    const uint32_t n8 = valid ? 8u : 0u;
    const int step = valid ? 1 : 0;  // invalid: every lane points at the (mapped) base, reads nothing
    constexpr int kChunks16 = F == KVFormat::kV32 ? 41 : 36;
    if (a16) {
      cp_async_16(dst + 16 * lane, data + step * 16 * lane, n16);
      if (lane < kChunks16 - 32) cp_async_16(dst + 16 * (lane + 32), data + step * 16 * (lane + 32), n16);
    } else {
#pragma unroll
      for (int c = lane; c < 2 * kChunks16; c += 32) cp_async_8(dst + 8 * c, data + step * 8 * c, n8);
    }
    if (F == KVFormat::kModel1) {
      const uint8_t* scales = shfl_ptr(mine.scales, k);
      if (lane == 31) cp_async_8(dst + Model1Layout::kDataBytes, scales, n8);
    }
  }
  if (lane < 8) valid_row[warp + 8 * lane] = mine.valid ? 1.f : 0.f;
}

// Q rows of heads 64*hg .. 64*hg+63 for (request r, query row s); rows past h_q are zeros.
template <KVFormat F>
__device__ __forceinline__ void load_q(const Params& p, int r, int s, int hg, uint32_t q_smem, int tid) {
  constexpr int kChunks = Fmt<F>::kDqk * 2 / 16;
  const int64_t base = (static_cast<int64_t>(r) * p.s_q + s) * p.h_q;
  for (int id = tid; id < kRows * kChunks; id += kThreads) {
    const int row = id / kChunks;
    const int c = id - row * kChunks;
    const int h = hg * kRows + row;
    const bool ok = h < p.h_q;
    const uint16_t* src = ok ? p.q + (base + h) * Fmt<F>::kDqk + 8 * c : p.q;
    cp_async_16(q_smem + row * Fmt<F>::kRowBytes + 16 * c, src, ok ? 16u : 0u);
  }
}

template <bool kSlow>
__device__ __forceinline__ void dequant_v32_tile(const uint8_t* src, uint8_t* dst, uint32_t mul2,
                                                 uint32_t& nan_acc) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint4 w[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) w[c] = *reinterpret_cast<const uint4*>(src + 16 * (4 * h + c));
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint4 o0, o1;
      nan_acc |= nan_flags(w[c]);
      dequant16<kSlow>(w[c], mul2, o0, o1);
      *reinterpret_cast<uint4*>(dst + 32 * (4 * h + c)) = o0;
      *reinterpret_cast<uint4*>(dst + 32 * (4 * h + c) + 16) = o1;
    }
  }
}

template <KVFormat F>
__device__ __forceinline__ void dequant_block(const uint8_t* raw, uint8_t* kbf, int tok, int qr) {
  const uint8_t* src = raw + tok * Fmt<F>::kRawStride;
  uint8_t* dst = kbf + tok * Fmt<F>::kRowBytes;
  uint32_t nan_acc = 0;
  int nan_dim = 0;
  if (F == KVFormat::kV32) {
    // quarter qr: NoPE tile qr (128 dims, one scale) + RoPE dims 16*qr .. 16*qr+15
    const float sc = *reinterpret_cast<const float*>(src + V32Layout::kScaleOffset + 4 * qr);
    const ScaleMul sm = scale_mul(bf16_bits_to_float(float_to_bf16_bits(sc)));
    if (!sm.slow) {
      dequant_v32_tile<false>(src + 128 * qr, dst + 256 * qr, sm.mul2, nan_acc);
    } else {
      dequant_v32_tile<true>(src + 128 * qr, dst + 256 * qr, sm.mul2, nan_acc);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
      *reinterpret_cast<uint4*>(dst + 2 * V32Layout::kNopeDims + 32 * qr + 16 * c) =
          *reinterpret_cast<const uint4*>(src + V32Layout::kRopeOffset + 32 * qr + 16 * c);
    nan_dim = 128 * qr;
  } else {
    // quarter qr: NoPE dims 112*qr .. 112*qr+111 (7 chunks of 16, each inside one
    // 64-dim tile) + RoPE dims 448 + 16*qr .. +15
    ScaleMul sm[7];
    bool any_slow = false;
#pragma unroll
    for (int c = 0; c < 7; ++c) {
      sm[c] = scale_mul(ue8m0_to_float(src[Model1Layout::kDataBytes + ((112 * qr + 16 * c) >> 6)]));
      any_slow |= sm[c].slow;
    }
    uint4 w[7];
#pragma unroll
    for (int c = 0; c < 7; ++c) w[c] = *reinterpret_cast<const uint4*>(src + 112 * qr + 16 * c);
#pragma unroll
    for (int c = 0; c < 7; ++c) {
      const int b0 = 112 * qr + 16 * c;
      uint4 o0, o1;
      nan_acc |= nan_flags(w[c]);
      if (!any_slow || !sm[c].slow) {
        dequant16<false>(w[c], sm[c].mul2, o0, o1);
      } else {
        dequant16<true>(w[c], sm[c].mul2, o0, o1);
      }
      *reinterpret_cast<uint4*>(dst + 2 * b0) = o0;
      *reinterpret_cast<uint4*>(dst + 2 * b0 + 16) = o1;
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
      *reinterpret_cast<uint4*>(dst + 2 * Model1Layout::kNopeDims + 32 * qr + 16 * c) =
          *reinterpret_cast<const uint4*>(src + Model1Layout::kRopeOffset + 32 * qr + 16 * c);
    nan_dim = 112 * qr;
  }
  if (nan_acc & 0x80808080u) *reinterpret_cast<uint16_t*>(dst + 2 * nan_dim) = 0x7fc0u;
}

template <KVFormat F>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel(const Params p) {
  using L = Smem<F>;
  constexpr int RB = Fmt<F>::kRowBytes;
  constexpr int kHalfSteps = Fmt<F>::kDqk / 32;  // k-steps of 16 dims per dim half

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // mma row group
  const int c4 = lane & 3;  // mma column pair
  const int worker = blockIdx.x;
  const int s = blockIdx.y;
  const int hg = blockIdx.z;

  const int32_t* row = p.sched + static_cast<int64_t>(worker) * kSchedFields;
  const int begin_req = row[kBeginReq];
  const int end_req = row[kEndReq];
  const int begin_block = row[kBeginBlock];
  const int end_block = row[kEndBlock];
  const int begin_split = row[kBeginSplit];
  if (begin_req > end_req) return;

  const uint32_t sbase = smem_u32(smem);
  const uint32_t q_s = sbase + L::kQ;
  const uint32_t k_s = sbase + L::kK;
  const uint32_t raw_s = sbase + L::kRaw;
  const uint32_t p_s = sbase + L::kP;
  uint8_t* kbf = smem + L::kK;
  const uint8_t* raw = smem + L::kRaw;
  float* sred = reinterpret_cast<float*>(smem + L::kSred);
  uint8_t* pbuf = smem + L::kP;
  float* validf = reinterpret_cast<float*>(smem + L::kValid);
  float* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha);
  float* m_s = reinterpret_cast<float*>(smem + L::kM);
  float* l_s = reinterpret_cast<float*>(smem + L::kL);

  // Dequant role: token `tok` of a block, quarter `qr` of its bytes.
  const int tok = tid & (kTokens - 1);
  const int qr = tid >> 6;
  // Gather role: lanes 0..7 of warp w fetch the index of token w + 8 * lane.
  const int gtok = warp + 8 * (lane & 7);
  // Softmax role: head row `srow`, 16 of its 64 tokens.
  const int srow = tid >> 2;
  const int sq = tid & 3;

  Cursor cur, nx, nx2;
  cursor_enter(cur, p, begin_req, begin_block, end_req, end_block);
  nx = cur;
  cursor_advance(nx, p, end_req, end_block);
  nx2 = nx;
  cursor_advance(nx2, p, end_req, end_block);

  // Prologue: Q of the first request and the bytes of the first block.
  load_q<F>(p, cur.r, s, hg, q_s, tid);
  {
    const TokenRef t0 = fetch_token<F>(cur, p, s, end_req, gtok);
    if (!(p.debug & 1)) issue_gather<F>(t0, raw_s, validf, warp, lane);
  }
  cp_async_commit();
  TokenRef tnext = fetch_token<F>(nx, p, s, end_req, gtok);

  float o[4][8][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[a][b][e] = 0.f;
  float m_run = kInitMax, l_run = 0.f;

  // QK^T roles.
  const int kh = warp >> 2;
  const int rg = (warp >> 1) & 1;
  const int cg = warp & 1;

  for (int j = 0;; ++j) {
    cp_async_wait_all();
    __syncthreads();  // block j's bytes and Q are in smem; the last PV is done with K
    dequant_block<F>(raw, kbf, tok, qr);
    __syncthreads();  // K tile ready; staging free

    if (nx.r <= end_req) {
      if (!(p.debug & 1)) issue_gather<F>(tnext, raw_s, validf + ((j + 1) & 1) * kTokens, warp, lane);
      cp_async_commit();
      tnext = fetch_token<F>(nx2, p, s, end_req, gtok);
    }

    // ---- S = Q K^T: warp computes rows 32rg.., tokens 32cg.., dims of half kh ----
    {
      float acc[2][4][4];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[a][b][e] = 0.f;
      const uint32_t a_base =
          q_s + (32 * rg + (lane & 7) + ((lane >> 3) & 1) * 8) * RB + ((lane >> 4) * 8) * 2;
      const uint32_t b_base =
          k_s + (32 * cg + (lane & 7) + (lane >> 4) * 8) * RB + (((lane >> 3) & 1) * 8) * 2;
      if (!(p.debug & 2))
#pragma unroll
      for (int ks = 0; ks < kHalfSteps; ++ks) {
        const uint32_t koff = (kh * kHalfSteps + ks) * 32;  // 16 dims = 32 bytes
        uint32_t af[2][4], bf[4][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldmatrix_x4(a_base + mt * 16 * RB + koff, af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
#pragma unroll
        for (int pp = 0; pp < 2; ++pp)
          ldmatrix_x4(b_base + pp * 16 * RB + koff, bf[2 * pp][0], bf[2 * pp][1], bf[2 * pp + 1][0],
                      bf[2 * pp + 1][1]);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) mma_bf16_16816(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
      }
      // Sum the two dim halves: warps 4..7 store, warps 0..3 add theirs.
      if (kh == 1) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int r0 = 32 * rg + 16 * mt + g;
            const int col = 32 * cg + 8 * nt + 2 * c4;
            *reinterpret_cast<float2*>(sred + r0 * kSredStride + col) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
            *reinterpret_cast<float2*>(sred + (r0 + 8) * kSredStride + col) =
                make_float2(acc[mt][nt][2], acc[mt][nt][3]);
          }
        named_bar_arrive(1, kThreads);
      } else {
        named_bar_sync(1, kThreads);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int r0 = 32 * rg + 16 * mt + g;
            const int col = 32 * cg + 8 * nt + 2 * c4;
            float2* p0 = reinterpret_cast<float2*>(sred + r0 * kSredStride + col);
            float2* p1 = reinterpret_cast<float2*>(sred + (r0 + 8) * kSredStride + col);
            float2 v0 = *p0, v1 = *p1;
            v0.x += acc[mt][nt][0];
            v0.y += acc[mt][nt][1];
            v1.x += acc[mt][nt][2];
            v1.y += acc[mt][nt][3];
            *p0 = v0;
            *p1 = v1;
          }
      }
    }
    __syncthreads();  // S complete; Q no longer read

    const bool last_of_req = nx.r != cur.r;

    // ---- online softmax (base 2): 4 threads per head row ----
    {
      const float* srow_p = sred + srow * kSredStride;
      const float* vrow = validf + (j & 1) * kTokens;
      const int pat = (sq & 1) + (sq >> 1) * 4;  // 16-byte units {0,1,4,5}: conflict-free reads
      float z[16];
      float bmax = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int u = pat + 2 * (i & 1) + 8 * (i >> 1);
        const float4 v = *reinterpret_cast<const float4*>(srow_p + 4 * u);
        const float4 ok = *reinterpret_cast<const float4*>(vrow + 4 * u);
        z[4 * i + 0] = ok.x != 0.f ? v.x * p.scale_log2 : -INFINITY;
        z[4 * i + 1] = ok.y != 0.f ? v.y * p.scale_log2 : -INFINITY;
        z[4 * i + 2] = ok.z != 0.f ? v.z * p.scale_log2 : -INFINITY;
        z[4 * i + 3] = ok.w != 0.f ? v.w * p.scale_log2 : -INFINITY;
#pragma unroll
        for (int e = 0; e < 4; ++e) bmax = fmaxf(bmax, z[4 * i + e]);
      }
      bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 1));
      bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, 2));
      const float m_new = fmaxf(m_run, bmax);
      const float alpha = exp2f(m_run - m_new);
      float psum = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int u = pat + 2 * (i & 1) + 8 * (i >> 1);
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pr[e] = exp2f(z[4 * i + e] - m_new);
          psum += pr[e];
        }
        *reinterpret_cast<uint2*>(pbuf + srow * kPStride + 8 * u) =
            make_uint2(pack_bf16x2(pr[0], pr[1]), pack_bf16x2(pr[2], pr[3]));
      }
      psum += __shfl_xor_sync(0xffffffffu, psum, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      l_run = l_run * alpha + psum;
      m_run = m_new;
      if (sq == 0) {
        alpha_s[srow] = alpha;
        m_s[srow] = m_run;
        l_s[srow] = l_run;
      }
      if (last_of_req) {
        m_run = kInitMax;
        l_run = 0.f;
      }
    }
    if (last_of_req && nx.r <= end_req) {  // Q buffer is free: fetch the next request's Q
      load_q<F>(p, nx.r, s, hg, q_s, tid);
      cp_async_commit();
    }
    __syncthreads();  // P, alpha ready

    // ---- O = alpha O + P V: warp owns value columns 64*warp .. 64*warp+63 ----
    {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const float a0 = alpha_s[16 * mt + g];
        const float a1 = alpha_s[16 * mt + g + 8];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          o[mt][nt][0] *= a0;
          o[mt][nt][1] *= a0;
          o[mt][nt][2] *= a1;
          o[mt][nt][3] *= a1;
        }
      }
      const uint32_t v_base =
          k_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * RB + (64 * warp + (lane >> 4) * 8) * 2;
      const uint32_t pa_base = p_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * kPStride + ((lane >> 4) * 8) * 2;
      if (!(p.debug & 2))
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t bf[8][2];
#pragma unroll
        for (int pp = 0; pp < 4; ++pp)
          ldmatrix_x4_trans(v_base + kk * 16 * RB + pp * 32, bf[2 * pp][0], bf[2 * pp][1], bf[2 * pp + 1][0],
                            bf[2 * pp + 1][1]);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          uint32_t af[4];
          ldmatrix_x4(pa_base + mt * 16 * kPStride + kk * 32, af[0], af[1], af[2], af[3]);
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) mma_bf16_16816(o[mt][nt], af, bf[nt][0], bf[nt][1]);
        }
      }
    }

    // ---- end of this request's piece: write results ----
    if (last_of_req) {
      const int r = cur.r;
      const int first_slot = p.num_splits[r];
      const int pieces = p.num_splits[r + 1] - first_slot;
      const int piece = r == begin_req ? begin_split : 0;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int hrow = 16 * mt + g + 8 * hf;
          const int h = hg * kRows + hrow;
          if (h >= p.h_q) continue;
          const float l = l_s[hrow];
          const float m = m_s[hrow];
          const bool empty = l == 0.f;
          const float inv = empty ? 0.f : 1.f / l;
          if (pieces == 1) {
            const float lse_nat = empty ? INFINITY : (log2f(l) + m) * kLn2;
            float f = inv;
            if (p.has_sink && !empty) f *= 1.f / (1.f + expf(p.attn_sink[r * p.sink_stride + h] - lse_nat));
            uint16_t* dst = p.out + ((static_cast<int64_t>(r) * p.s_q + s) * p.h_q + h) * kDimV + 64 * warp + 2 * c4;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
              *reinterpret_cast<uint32_t*>(dst + 8 * nt) =
                  pack_bf16x2(o[mt][nt][2 * hf] * f, o[mt][nt][2 * hf + 1] * f);
            }
            if (warp == 0 && c4 == 0) p.lse[(static_cast<int64_t>(r) * p.h_q + h) * p.s_q + s] = lse_nat;
          } else {
            const int64_t slot = first_slot + piece;
            float* dst = p.out_accum + ((slot * p.s_q + s) * p.h_q + h) * kDimV + 64 * warp + 2 * c4;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
              *reinterpret_cast<float2*>(dst + 8 * nt) =
                  make_float2(o[mt][nt][2 * hf] * inv, o[mt][nt][2 * hf + 1] * inv);
            if (warp == 0 && c4 == 0)
              p.lse_accum[(slot * p.s_q + s) * p.h_q + h] = empty ? -INFINITY : log2f(l) + m;
          }
        }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 8; ++b)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[a][b][e] = 0.f;
    }

    if (nx.r > end_req) break;
    cur = nx;
    nx = nx2;
    cursor_advance(nx2, p, end_req, end_block);
  }
}

template <KVFormat F>
ffi::Error launch_kernel(const DecodeProblem& dp, cudaStream_t stream) {
  constexpr int kSmem = Smem<F>::kBytes;
  static bool configured[64] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cuda_failure("cudaGetDevice", e);
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    e = cudaFuncSetAttribute(decode_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return cuda_failure("cudaFuncSetAttribute(decode_kernel)", e);
    if (dev >= 0 && dev < 64) configured[dev] = true;
  }
  const Params p = make_params(dp);

  const dim3 grid(dp.num_parts, dp.s_q, (dp.h_q + kRows - 1) / kRows);
  decode_kernel<F><<<grid, kThreads, kSmem, stream>>>(p);
  return check_launch("decode_kernel");
}


}  // namespace

ffi::Error launch_mma_sync(const DecodeProblem& dp, cudaStream_t stream) {
  if (dp.format == KVFormat::kV32) return launch_kernel<KVFormat::kV32>(dp, stream);
  return launch_kernel<KVFormat::kModel1>(dp, stream);
}

}  // namespace cuda
}  // namespace jsm

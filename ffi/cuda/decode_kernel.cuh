// jsm_decode's kernel on Hopper: warp-specialized, wgmma. The launch configuration is in
// decode_launch.cu.
//
// One CTA of 384 threads (three warpgroups) per (worker, query row, group of 64 heads),
// one CTA per SM. For each block of 64 list entries (split_plan.h):
//   warpgroup 2 (producer): loads the entries' cache bytes into registers, dequantizes
//     them (kv_format.h's rule, hardware conversions) and stores the bf16 K tile into one
//     of two shared buffers, then signals the buffer's `full` mbarrier. It runs ahead of
//     the stores: later blocks' bytes are requested into registers or L2 and their
//     indices loaded before the current block is dequantized.
//   warpgroup 0: S = Q K^T (wgmma, both from smem; Q brought by the copy engine, one bulk
//     tensor copy per 64 columns, at each piece's start), online softmax in base 2, P rounded
//     to bf16 (its A fragments: in registers, and a copy in smem for WG1),
//     O[:, 0:256] = alpha O + P V with P from registers.
//   warpgroup 1: loads WG0's fragments of P and alpha into registers (freeing them for
//     the next block at once), then O[:, 256:512] = alpha O + P V with P from registers.
//   Each consumer warp arrives on the buffer's `empty` mbarrier once its MMAs have read
//   it; after waiting on `full` the consumers fence the proxy (the producer writes with
//   ordinary stores, wgmma reads through the async proxy).
// At the end of a request's piece both consumers write their half of the output
// columns: out/lse (one piece) or the fp32 partials for the combine pass; a whole
// request's output in the CTA's last piece goes through the then free K tiles and out by
// bulk copies (store_o_staged).
// Invalid entries are never read: their rows are zeros and their logits -inf.
//
// With two or more head groups the CTAs of head groups 2i and 2i + 1 (same worker, same
// query row: they walk the same blocks) form a cluster of two. Each CTA's producer then
// handles half of every block (one entry per thread) and writes the bf16 rows into both
// CTAs' K tiles (the peer's through st.async, which completes on the peer's `full`);
// `empty` waits for both CTAs' consumers. Dequantization is the producer's wall, so this
// halves it, and one entry per thread leaves the registers to hold the next block's bytes.
#pragma once

#include <type_traits>

#include "cuda/cluster.cuh"
#include "cuda/cta_timeline.cuh"
#include "cuda/decode_common.cuh"
#include "cuda/wgmma.cuh"

namespace jsm {
namespace cuda {

constexpr int kThreads = 384;
constexpr int kWarpgroup = 128;
constexpr int kConsumers = 256;
constexpr int kConsumerWarps = kConsumers / 32;
constexpr int kProducers = 128;
// Registers per thread after reallocation; the launch gives 168 (65536 / 384, a multiple
// of 8), so the three counts sum to at most 3 * 168 = 504 (`.inc` waits for registers the
// others released). ptxas allocates each role's code within its own count.
// WG0: at 192 ptxas put the row sums before P's hand-over in the pair kernel (4% slower).
// The producer at 128 holds one entry's raw bytes at a time (see produce_solo).
constexpr int kRegsQK = 200;
constexpr int kRegsPV = 176;  // O (128) and P's A fragments (16) for an RS product; at 168 ptxas serializes them
constexpr int kRegsProducer = 128;
constexpr int kRegsLaunch = 168;
static_assert(kRegsQK + kRegsPV + kRegsProducer <= 3 * kRegsLaunch,
              "setmaxnreg counts over the launch's registers");

// This warpgroup's registers to N: `.inc` above the launch's count, `.dec` below (the
// other way round is an illegal instruction).
template <int N>
__device__ __forceinline__ void set_registers() {
  if constexpr (N > kRegsLaunch) {
    setmaxnreg_inc<N>();
  } else if constexpr (N < kRegsLaunch) {
    setmaxnreg_dec<N>();
  }
}
// Named barriers (0 is __syncthreads).
constexpr int kBarPReady = 1;    // WG0 -> WG1: P and alpha of this block are in smem
constexpr int kBarPFree = 2;     // WG1 -> WG0: done reading them
constexpr int kBarPieceEnd = 3;  // both: the final row factors are in smem

// The byte layouts of common/kv_format.h as the producer reads them: 64-byte spans of
// codes (16 bytes per thread of a quad), each inside one scale tile.
template <KVFormat F>
struct Fmt {
  using Layout = std::conditional_t<F == KVFormat::kV32, V32Layout, Model1Layout>;
  static constexpr int kDqk = Layout::kDimQK;
  static constexpr int kNope = Layout::kNopeDims;
  static constexpr int kNopeSpans = kNope / 64;
  static constexpr int kSpansPerScale = Layout::kTileDims / 64;
  static constexpr int kScales = Layout::kNumTiles;
  static constexpr int kRopeOffset = Layout::kRopeOffset;
};

// Row pitch of O staged in shared memory (a consumer's 256 columns in bf16): a warp's
// stores to 8 rows then fall in distinct banks (one 128-byte wavefront).
constexpr int kStagePitch = kDimV / 2 * 2 + 16;
static_assert(kStagePitch % 16 == 0, "bulk copies need 16-byte aligned rows");

// Shared memory. The two K tiles and P use the interleaved operand layout of wgmma.cuh:
// element (row, col) at (col / 8) * 64 * 16 + row * 16 + (col % 8) * 2. Q is in 64-column
// slices of 8 KB (kQSlice), each in the 128-byte swizzle layout (desc_k_major_sw128), as
// its bulk tensor copies write it; the slices need 1024-byte alignment, which offset 0 of
// the dynamic shared memory has (the kernel declares no static shared memory).
template <KVFormat F>
struct Smem {
  static constexpr int kGroupStride = kRows * 16;  // bytes per column group (64 rows)
  static constexpr int kTile = Fmt<F>::kDqk * kRows * 2;
  static constexpr int kQ = 0;
  static constexpr int kQSlice = 64 * kRows * 2;  // 64 columns of Q
  static constexpr int kK = kQ + kTile;  // two buffers
  static constexpr int kP = kK + 2 * kTile;
  static constexpr int kAlpha = kP + kTokens * kRows * 2;  // 64 floats
  static constexpr int kFinal = kAlpha + kRows * 4;        // 2 x 64 floats (by piece parity)
  static constexpr int kValid = kFinal + 2 * kRows * 4;    // 2 x 8 words: bits of entries 8 k .. 8 k + 7
  static constexpr int kFull = kValid + 2 * 8 * 4;         // 2 mbarriers
  static constexpr int kEmpty = kFull + 2 * 8;             // 2 mbarriers
  static constexpr int kQFull = kEmpty + 2 * 8;            // 1 mbarrier: Q's copies landed
  static constexpr int kBytes = kQFull + 8;
  static_assert(kQ % 1024 == 0 && Fmt<F>::kDqk % 64 == 0, "Q's swizzled slices");
  static_assert(kBytes <= 232448, "shared memory over the sm_90 per-block limit");
  static_assert(2 * kRows * kStagePitch <= 2 * kTile, "the K tiles hold O staged");
  static_assert(kValid % 16 == 0, "valid words are read as 16-byte vectors");
};

struct Work {
  int begin_req, end_req, begin_block, end_block, begin_split;
  // The plan was made for other lengths than this call's: the worker's boundary at its
  // first / last request does not match that request's block count.
  bool stale_begin, stale_end;
};

// A worker's row of the plan, made safe to walk whatever it holds. The handler cannot
// check a plan without a host sync, so the kernel does: requests outside the batch make
// the worker idle, block ranges are clamped to what a request can hold (the walk ends,
// and entries past a request's length are never read), and output slots are checked
// where they are written (piece_out). A plan made from other lengths (a stale plan)
// could leave a request's last blocks unread where a worker's boundary no longer matches
// the request's block count: the pieces of such a request that the worker writes are
// NaN, so a stale plan never gives a finite wrong answer. (A request inside a worker's
// range is walked by this call's lengths and needs no check.)
__device__ __forceinline__ Work read_work(const Params& p, int worker) {
  const int32_t* row = p.sched + static_cast<int64_t>(worker) * kSchedFields;
  Work w;
  w.begin_req = row[kBeginReq];
  w.end_req = row[kEndReq];
  if (w.begin_req > w.end_req || w.begin_req < 0 || w.end_req >= p.batch) {
    w.begin_req = 1;
    w.end_req = 0;  // idle
    return w;
  }
  const int max_blocks = main_blocks(p.topk) + extra_blocks(p.extra_topk);
  w.begin_block = min(max(row[kBeginBlock], 0), max_blocks - 1);
  w.end_block = min(max(row[kEndBlock], 1), max_blocks);
  w.begin_split = row[kBeginSplit];
  const int end_blocks = request_blocks(p, w.end_req);
  w.stale_end = row[kIsLastSplit] ? w.end_block != end_blocks : w.end_block >= end_blocks;
  w.stale_begin = w.begin_block > 0 && w.begin_block >= request_blocks(p, w.begin_req);
  return w;
}

// Keeps the compiler from reading, moving or reusing registers a wgmma in flight owns
// (accumulators, register A fragments) between its issue and its wait.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void pin(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void zero(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = 0.f;
}

// exp2 on the special-function unit; results under 2^-126 flush to zero (negligible
// probabilities next to the row maximum's 1).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- producer ----

// One token's share of a producer thread: 16 bytes of each 64-byte span of codes, 16
// bytes of each half of the RoPE part, and the token's scales.
template <KVFormat F>
struct RawToken {
  uint4 nope[Fmt<F>::kNopeSpans];
  uint4 rope[2];
  uint4 scales;  // V32: 4 float32; MODEL1: 8 UE8M0 bytes in .x, .y
};

// 16 bytes of a token row. Aligned rows: one load whose L2 fetch spans the surrounding
// 256 bytes, so an entry's later spans find their lines already on the way.
template <bool kAligned>
__device__ __forceinline__ uint4 load16(const uint8_t* src) {
  if (kAligned) {
    uint4 r;
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
    return r;
  }
  const uint2 lo = __ldg(reinterpret_cast<const uint2*>(src));
  const uint2 hi = __ldg(reinterpret_cast<const uint2*>(src + 8));
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

template <KVFormat F, bool kAligned>
__device__ __forceinline__ void load_token(const TokenRef& t, int q4, RawToken<F>& raw) {
  if (t.data == nullptr || kSkipLoads) {
#pragma unroll
    for (int i = 0; i < Fmt<F>::kNopeSpans; ++i) raw.nope[i] = make_uint4(0, 0, 0, 0);
    raw.rope[0] = raw.rope[1] = raw.scales = make_uint4(0, 0, 0, 0);
    return;
  }
#pragma unroll
  for (int i = 0; i < Fmt<F>::kNopeSpans; ++i) raw.nope[i] = load16<kAligned>(t.data + 64 * i + 16 * q4);
#pragma unroll
  for (int r = 0; r < 2; ++r) raw.rope[r] = load16<kAligned>(t.data + Fmt<F>::kRopeOffset + 64 * r + 16 * q4);
  if (F == KVFormat::kV32) {
    raw.scales = load16<kAligned>(t.data + V32Layout::kScaleOffset);
  } else {
    const uint2 b = __ldg(reinterpret_cast<const uint2*>(t.scales));
    raw.scales = make_uint4(b.x, b.y, 0, 0);
  }
}

// Brings a valid entry's bytes into L2, so that the register loads a block later wait for
// L2 rather than for memory. kBulk (16-byte-aligned rows only): one bulk prefetch of the row
// by the copy engine (lane q4 = 0), which costs the LSU nothing; otherwise lanes q4 and
// q4 + 4 touch its 128-byte lines. Measured (NOTES, session 8): bulk takes 3.7% off the pair
// kernel and adds 4% to the few-heads one, so only produce_pair uses it.
template <KVFormat F, bool kBulk>
__device__ __forceinline__ void prefetch_token_l2(const TokenRef& t, int q4) {
  if (t.data == nullptr || kSkipLoads || kSkipPrefetch) return;
  constexpr int kRowBytes = F == KVFormat::kV32 ? V32Layout::kBytesPerToken : Model1Layout::kDataBytes;
  static_assert(kRowBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  if (kBulk) {
    if (q4 == 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(t.data), "n"(kRowBytes) : "memory");
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int off = 128 * (q4 + 4 * k);
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(t.data + (off < kRowBytes ? off : kRowBytes - 1)));
    }
  }
  if (F == KVFormat::kModel1 && q4 == 0) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(t.scales));
}

// bf16(scale) of each tile, in both halves of a word.
template <KVFormat F>
__device__ __forceinline__ void tile_scales(const uint4& s, uint32_t (&scale2)[Fmt<F>::kScales]) {
  if (F == KVFormat::kV32) {
    const uint32_t w[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int k = 0; k < Fmt<F>::kScales; ++k) scale2[k] = bf16x2_splat(__uint_as_float(w[k & 3]));
  } else {
#pragma unroll
    for (int k = 0; k < Fmt<F>::kScales; ++k) scale2[k] = ue8m0_bf16x2(((k < 4 ? s.x : s.y) >> (8 * (k & 3))) & 0xffu);
  }
}

// Dequantizes the thread's share of one entry into row `tok` of the K tile at `kt` and,
// kPeer, of the peer CTA's tile at cluster address `peer_kt` (st.async completing on the
// peer's `full` barrier `peer_full`).
template <KVFormat F, bool kPeer>
__device__ __forceinline__ void store_token(const RawToken<F>& raw, uint8_t* kt, uint32_t peer_kt, uint32_t peer_full,
                                            int tok, int q4) {
  if (kSkipStores) return;
  constexpr int GS = Smem<F>::kGroupStride;
  uint8_t* dst = kt + tok * 16;
  const uint32_t peer_dst = peer_kt + tok * 16;
  uint32_t scale2[Fmt<F>::kScales];
  tile_scales<F>(raw.scales, scale2);
  auto put = [&](int g, const uint4& v, bool to_peer) {  // column group g of the row
    *reinterpret_cast<uint4*>(dst + g * GS) = v;
    if (kPeer && to_peer) st_async_v4(peer_dst + g * GS, v, peer_full);
  };
  // Timing experiments 5-7 (decode_common.cuh): what the peer is not sent goes into the peer
  // entry's row of this CTA's own tile ("twin"), so that the tile holds realistic values (the
  // softmax's work depends on them) and the shared-memory writes stay.
  uint8_t* twin = kt + (tok ^ (kTokens / 2)) * 16;
  auto put_twin = [&](int g, const uint4& v) { *reinterpret_cast<uint4*>(twin + g * GS) = v; };
#pragma unroll
  for (int i = 0; i < Fmt<F>::kNopeSpans; ++i) {
    uint4 o0, o1;
    dequant16(raw.nope[i], scale2[i / Fmt<F>::kSpansPerScale], o0, o1);
    put(8 * i + 2 * q4, o0, !kSkipPeerRows);
    put(8 * i + 2 * q4 + 1, o1, !kSkipPeerRows);
    if (kPeer && kSkipPeerRows) {
      if (kConvertPeerRows) {  // experiment 7: converted a second time, from sign-flipped codes
        const uint4 w = raw.nope[i];  // (other input, so nothing is shared; valid codes stay valid)
        dequant16(make_uint4(w.x ^ 0x80808080u, w.y ^ 0x80808080u, w.z ^ 0x80808080u, w.w ^ 0x80808080u),
                  scale2[i / Fmt<F>::kSpansPerScale], o0, o1);
      }
      put_twin(8 * i + 2 * q4, o0);
      put_twin(8 * i + 2 * q4 + 1, o1);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    put(Fmt<F>::kNope / 8 + 4 * r + q4, raw.rope[r], !kSkipPeerRope);
    if (kPeer && kSkipPeerRope) put_twin(Fmt<F>::kNope / 8 + 4 * r + q4, raw.rope[r]);
  }
}

// Producer warpgroup `part` of a CTA on its own: with kEntries = 2 (one producer
// warpgroup) thread t handles entries slot and slot + 32 of every block; with kEntries = 1
// (two) entry 32 part + slot. 16 bytes of each 64-byte span (q4): a warp instruction reads
// 64 contiguous bytes of 8 entries and writes 4 x 128 contiguous bytes of the tile. A
// block's bytes are loaded when it is its turn; the next block's are prefetched into L2 a
// block earlier, their indices two earlier.
// `t`: the thread's index in its warpgroup; `L`: the shared-memory layout (its K tiles,
// valid words and barriers).
template <KVFormat F, bool kAligned, int kEntries, typename L = Smem<F>>
__device__ __forceinline__ void produce_solo(const Params& p, const Work& w, int s, uint32_t sb, uint8_t* smem,
                                             int part, int t) {
  const int pw = t >> 5;
  const int lane = t & 31;
  const int slot = 32 * part + 8 * pw + (lane & 7);
  const int q4 = lane >> 3;
  uint32_t* valid_words = reinterpret_cast<uint32_t*>(smem + L::kValid);

  Cursor c;
  cursor_enter(c, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  TokenRef cur[kEntries];  // block n
#pragma unroll
  for (int e = 0; e < kEntries; ++e) cur[e] = resolve_entry<F>(load_entry(c, p, s, w.end_req, slot + 32 * e), p);
  cursor_advance(c, p, w.end_req, w.end_block);
  bool has_next = c.r <= w.end_req;
  EntryIndex idx[kEntries];  // block n + 1
#pragma unroll
  for (int e = 0; e < kEntries; ++e) idx[e] = load_entry(c, p, s, w.end_req, slot + 32 * e);
  cursor_advance(c, p, w.end_req, w.end_block);  // c: block n + 2

  for (int n = 0;; ++n) {
    RawToken<F> raw[kEntries];
    TokenRef nxt[kEntries];
    EntryIndex idx2[kEntries];
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      if (e == 0) load_token<F, kAligned>(cur[e], q4, raw[e]);  // the others after the wait (below)
      nxt[e] = resolve_entry<F>(idx[e], p);
      prefetch_token_l2<F, false>(nxt[e], q4);
      idx2[e] = load_entry(c, p, s, w.end_req, slot + 32 * e);
    }

    const int buf = n & 1;
    uint8_t* kt = smem + L::kK + buf * L::kTile;
    long long span_t = span_clock();
    mbar_wait(sb + L::kEmpty + 8 * buf, ((n >> 1) & 1) ^ 1);
    span_add(t == 0 && part == 0, kSpanProducerWaitEmpty, span_t);
    span_t = span_clock();
    // Entry 1's bytes are requested once the buffer is free: two entries' raw bytes and the
    // conversions do not fit the producer's 128 registers (they spilled 156 bytes).
#pragma unroll
    for (int e = 1; e < kEntries; ++e) load_token<F, kAligned>(cur[e], q4, raw[e]);
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      store_token<F, false>(raw[e], kt, 0, 0, slot + 32 * e, q4);
      const uint32_t v = __ballot_sync(0xffffffffu, cur[e].data != nullptr) & 0xffu;  // lanes 0..7: entries slot ..
      if (lane == 0) valid_words[8 * buf + 4 * (part + e) + pw] = v;
    }
    mbar_arrive(sb + L::kFull + 8 * buf);  // (the consumers make the tile visible to wgmma)
    span_add(t == 0 && part == 0, kSpanProducerStore, span_t);

    if (!has_next) break;
    has_next = c.r <= w.end_req;
    cursor_advance(c, p, w.end_req, w.end_block);
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      cur[e] = nxt[e];
      idx[e] = idx2[e];
    }
  }
}

// Bytes a pair producer writes into its peer per block: half the tile's rows and 4
// valid-mask words.
template <KVFormat F>
constexpr uint32_t kPeerBytes =
    (kTokens / 2) * ((kSkipPeerRows ? 0 : Fmt<F>::kNope) + (kSkipPeerRope ? 0 : Fmt<F>::kDqk - Fmt<F>::kNope)) * 2 +
    4 * 4;

// Producer of one CTA of a cluster pair: thread t handles entry 32 * rank + slot of every
// block and writes it into both CTAs' tiles; the peer's producer does the other half.
// Block n+1's bytes are requested into registers before block n is dequantized, block
// n+2's are prefetched into L2, and block n+3's indices loaded.
template <KVFormat F, bool kAligned>
__device__ __forceinline__ void produce_pair(const Params& p, const Work& w, int s, uint32_t sb, uint32_t peer,
                                             uint8_t* smem) {
  using L = Smem<F>;
  const int t = threadIdx.x - kConsumers;
  const int pw = t >> 5;
  const int lane = t & 31;
  const int rank = cluster_ctarank();
  const int slot = 32 * rank + 8 * pw + (lane & 7);
  const int q4 = lane >> 3;
  const int valid_word = L::kValid + 4 * (4 * rank + pw);  // + 32 * buf; lanes 0..7 hold its bits

  Cursor c;
  cursor_enter(c, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  TokenRef cur = resolve_entry<F>(load_entry(c, p, s, w.end_req, slot), p);  // block n
  RawToken<F> raw;
  load_token<F, kAligned>(cur, q4, raw);
  cursor_advance(c, p, w.end_req, w.end_block);
  bool has1 = c.r <= w.end_req;  // block n + 1 exists
  TokenRef pf = resolve_entry<F>(load_entry(c, p, s, w.end_req, slot), p);  // block n + 1, in L2
  prefetch_token_l2<F, kAligned>(pf, q4);
  cursor_advance(c, p, w.end_req, w.end_block);
  bool has2 = c.r <= w.end_req;
  EntryIndex idx = load_entry(c, p, s, w.end_req, slot);  // block n + 2
  cursor_advance(c, p, w.end_req, w.end_block);           // c: block n + 3
  cluster_wait();  // (decode_kernel: the first loads above went out before it)

  for (int n = 0;; ++n) {
    RawToken<F> next;
    load_token<F, kAligned>(pf, q4, next);  // absent past the end: nothing is loaded
    const TokenRef pf2 = resolve_entry<F>(idx, p);
    prefetch_token_l2<F, kAligned>(pf2, q4);
    const EntryIndex idx3 = load_entry(c, p, s, w.end_req, slot);

    const int buf = n & 1;
    const int tile = L::kK + buf * L::kTile;
    const uint32_t full = L::kFull + 8 * buf;
    stamp(t == 0 && n == 0, kStampProducerIssued);
    long long span_t = span_clock();
    mbar_wait(sb + L::kEmpty + 8 * buf, ((n >> 1) & 1) ^ 1);  // both CTAs' consumers are done with it
    span_add(t == 0, kSpanProducerWaitEmpty, span_t);
    span_t = span_clock();
    store_token<F, true>(raw, smem + tile, peer + tile, peer + full, slot, q4);
    const uint32_t v = __ballot_sync(0xffffffffu, cur.data != nullptr) & 0xffu;
    if (lane == 0) {
      *reinterpret_cast<uint32_t*>(smem + valid_word + 32 * buf) = v;
      if (!kSkipStores) st_async_u32(peer + valid_word + 32 * buf, v, peer + full);
    }
    // This CTA's barrier: the local producers' arrivals plus the peer's st.async bytes.
    if (t == 0 && !kSkipStores) {
      mbar_arrive_expect_tx(sb + full, kPeerBytes<F>);
    } else {
      mbar_arrive(sb + full);
    }
    stamp(t == 0 && n == 0, kStampProducerStored);
    span_add(t == 0, kSpanProducerStore, span_t);

    if (!has1) break;
    has1 = has2;
    has2 = c.r <= w.end_req;
    cursor_advance(c, p, w.end_req, w.end_block);
    cur = pf;
    raw = next;
    pf = pf2;
    idx = idx3;
  }
}

// ---- consumers ----

// Thread 0 initializes both buffers' `full` barriers (`full`, `full` + 8: one arrival per
// producer thread) and `empty` barriers (one per consumer warp, of both CTAs in a pair).
__device__ __forceinline__ void init_tile_barriers(uint32_t full, uint32_t empty, int producers, int consumer_warps,
                                                   uint32_t q_full) {
  if (threadIdx.x != 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mbar_init(full + 8 * i, producers);
    mbar_init(empty + 8 * i, consumer_warps);
  }
  mbar_init(q_full, 1);
  fence_mbarrier_init_cluster();  // (alone too: the copy engine completes q_full)
}

// Waits until buffer `buf`'s tile is complete (in a pair, with the peer's half), then
// makes the producers' generic-proxy stores visible to this thread's wgmma reads.
__device__ __forceinline__ void wait_full(uint32_t bar, uint32_t parity) {
  mbar_wait(bar, parity);
  fence_proxy_async();
}

// Called once the warp's wgmmas reading the buffer have completed: one arrival per warp
// on `empty` (of both CTAs in a cluster: the peer's producer writes here too). The local
// arrival releases (CTA scope, after the __syncwarp: the whole warp's reads), so that the
// producer's next stores of the valid words are ordered after this warp's loads of them.
template <int kCluster>
__device__ __forceinline__ void release_tile(uint32_t bar, uint32_t peer_bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    mbar_arrive(bar);
    if (kCluster > 1) mbar_arrive_relaxed(peer_bar);
  }
  __syncwarp();
}

// Q rows of heads h0 .. h0 + 63 for (request r, query row s): one bulk tensor copy per
// 64-column slice (kQSlice bytes, swizzled), all issued by thread 0 of a consumer warpgroup
// (t: the thread's index in it; WG0 for a worker's first Q, WG1 at each later piece's start),
// which also arms the mbarrier `bar` with their bytes: its phase flips once every slice has
// landed. Rows past h_q lie outside the map and land as zeros.
// The copy engine reads Q, so its loads do not queue with the producer's in the load/store
// unit (b = 1: Q in shared memory 4.7 -> 1.1 us after the CTA's start, NOTES session 34).
// Issuing from one thread, not a lane per slice, is a register-allocation choice: with lanes,
// ptxas spilled ~100 bytes in the consumers' loops of the CTA-alone kernels. `p` must be the
// kernel's __grid_constant__ parameter: the copies read the map where the launch put it.
template <KVFormat F>
__device__ __forceinline__ void load_q(const Params& p, int r, int s, int h0, uint32_t q_s, uint32_t bar, int t) {
  constexpr int kSlices = Fmt<F>::kDqk / 64;
  if (t != 0) return;
  mbar_arrive_expect_tx(bar, kSlices * Smem<F>::kQSlice);
  const uint64_t map = reinterpret_cast<uint64_t>(&p.q_map);
#pragma unroll
  for (int i = 0; i < kSlices; ++i) tensor_load_3d(q_s + i * Smem<F>::kQSlice, map, 64 * i, h0, r * p.s_q + s, bar);
}

struct PieceOut {
  int r, pieces;
  int64_t slot;  // partial slot (pieces > 1)
  bool write;    // false: the plan names a slot outside the partial buffers (nothing is written)
};

__device__ __forceinline__ PieceOut piece_out(const Params& p, const Work& w, int r) {
  const int first_slot = p.num_splits[r];
  PieceOut po;
  po.r = r;
  po.pieces = p.num_splits[r + 1] - first_slot;
  po.slot = static_cast<int64_t>(first_slot) + (r == w.begin_req ? w.begin_split : 0);
  po.write = po.pieces == 1 || (po.slot >= 0 && po.slot < p.num_slots);
  return po;
}

// Head h's result for the piece that ends here, from its row sum and running maximum
// (base 2): returns the factor its O row is scaled by (1 / sum, times the sink's share
// when the piece is the whole request; 0 for an empty row; NaN where the worker's plan is
// stale), and `writer` stores its lse (natural, or the base-2 partial lse for the combine).
__device__ __forceinline__ float finish_head(const Params& p, const Work& w, const PieceOut& po, int s, int h,
                                             float sum, float m, bool writer) {
  const bool empty = sum == 0.f;
  const bool stale = (po.r == w.end_req && w.stale_end) || (po.r == w.begin_req && w.stale_begin);
  float f = stale ? NAN : (empty ? 0.f : 1.f / sum);
  if (po.pieces == 1) {
    const float lse_nat = stale ? NAN : (empty ? INFINITY : (log2f(sum) + m) * kLn2);
    if (p.has_sink && !empty && h < p.h_q) f *= 1.f / (1.f + expf(p.attn_sink[po.r * p.sink_stride + h] - lse_nat));
    if (writer && h < p.h_q) p.lse[(static_cast<int64_t>(po.r) * p.h_q + h) * p.s_q + s] = lse_nat;
  } else if (writer && h < p.h_q && po.write) {
    p.lse_accum[(po.slot * p.s_q + s) * p.h_q + h] = stale ? NAN : (empty ? -INFINITY : log2f(sum) + m);
  }
  return f;
}

// Output columns 8 j + 2 c and 8 j + 2 c + 1 of a consumer's row half hf (row r0 + 8 hf),
// scaled by its factor, as the bf16 pair written to `out`.
__device__ __forceinline__ uint32_t out_pair_bf16(const float (&o)[128], const float (&f)[2], int hf, int j) {
  return pack_bf16x2(o[4 * j + 2 * hf] * f[hf], o[4 * j + 2 * hf + 1] * f[hf]);
}

// A 4 x 4 transpose across a quad's threads (lane % 4 = c): thread c's v[m] goes to
// thread m's v[c]. Two butterfly stages of two shuffles; every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int c) {
#pragma unroll
  for (int b = 2; b >= 1; b /= 2) {
    const bool hi = (c & b) != 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m & b) continue;
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, hi ? v[m] : v[m | b], b);
      if (hi) {
        v[m] = recv;
      } else {
        v[m | b] = recv;
      }
    }
  }
}

// Writes a consumer's 64 x 256 half of O (columns col0 ..), rows scaled by f. A thread holds
// 2 of every 8 columns of its rows; quad_transpose gives it 8 whole columns of every 4th
// group instead, so that a quad's bf16 store writes 64 contiguous bytes (two whole 32-byte
// sectors) rather than 16 (half of one). The fp32 partials keep their 8-byte stores, which
// already fill a sector a quad; a transposed version (32 bytes a thread, as two 16-byte halves)
// measured 2.6 us slower at b = 1, where every piece is a partial.
__device__ __forceinline__ void store_o(const Params& p, const float (&o)[128], const float (&f)[2],
                                        const PieceOut& po, int s, int hg, int r0, int c, int col0) {
  if (!po.write) return;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int h = hg * kRows + r0 + 8 * hf;
    const bool row_out = h < p.h_q;  // (the shuffles run in every lane)
    if (po.pieces == 1) {
      uint16_t* dst = p.out + ((static_cast<int64_t>(po.r) * p.s_q + s) * p.h_q + h) * kDimV + col0;
#pragma unroll
      for (int k = 0; k < 8; ++k) {  // column groups 4 k .. 4 k + 3
        uint32_t v[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) v[m] = out_pair_bf16(o, f, hf, 4 * k + m);
        quad_transpose(v, c);
        if (row_out) *reinterpret_cast<uint4*>(dst + 8 * (4 * k + c)) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    } else {
      float* dst = p.out_accum + ((po.slot * p.s_q + s) * p.h_q + h) * kDimV + col0 + 2 * c;
      if (!row_out) continue;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * hf] * f[hf], o[4 * j + 2 * hf + 1] * f[hf]);
    }
  }
}

// store_o for a whole request's output (bf16), through shared memory at `stage` (the
// consumer of columns col0 .. takes rows col0 / 256 x 64 ..): each warp writes its 16 rows,
// then copies each to global memory with one bulk copy. The register stores write 16 bytes
// of a row per instruction, half a sector; the copy engine writes whole rows. Measured
// (NOTES, session 16): fp32 partials, which the register stores write in whole sectors,
// came out slower this way at b = 1. For the CTA's last piece, when the K tiles are free
// (`stage` = their start); needs a 16-byte aligned `out` (`stage_output`).
__device__ __forceinline__ void store_o_staged(const Params& p, const float (&o)[128], const float (&f)[2],
                                               const PieceOut& po, int s, int hg, int r0, int c, int col0,
                                               uint8_t* stage) {
  uint8_t* rows = stage + col0 / (kDimV / 2) * kRows * kStagePitch;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    uint8_t* dst = rows + (r0 + 8 * hf) * kStagePitch + 4 * c;
#pragma unroll
    for (int j = 0; j < 32; ++j) *reinterpret_cast<uint32_t*>(dst + 16 * j) = out_pair_bf16(o, f, hf, j);
  }
  fence_proxy_async();  // the rows, visible to the copy engine
  __syncwarp();
  const int lane = threadIdx.x & 31;
  if (lane < 16) {
    const int row = (r0 & ~15) + lane;  // the warp's rows are 16 w .. 16 w + 15
    const int h = hg * kRows + row;
    if (h < p.h_q) {
      uint16_t* dst = p.out + ((static_cast<int64_t>(po.r) * p.s_q + s) * p.h_q + h) * kDimV + col0;
      bulk_store(dst, smem_u32(rows + row * kStagePitch), kDimV / 2 * 2);
    }
    bulk_commit();
    bulk_wait_read();
  }
}

// Whether a piece's output goes out by store_o_staged: the CTA's last piece (`last_piece`:
// no block is coming, the K tiles are free once both consumers are past the piece-end
// barrier), a whole request's, into a 16-byte aligned `out`.
__device__ __forceinline__ bool stage_output(const Params& p, const PieceOut& po, bool last_piece) {
  return last_piece && po.write && po.pieces == 1 && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
}

// A consumer's piece end: its half of O (columns col0 ..) out by the path stage_output picks
// (`stage`: the K tiles, free past the piece-end barrier). Timing experiment 12 skips every
// piece's stores but the CTA's last.
__device__ __forceinline__ void store_piece(const Params& p, const float (&o)[128], const float (&f)[2],
                                            const PieceOut& po, int s, int hg, int r0, int c, int col0,
                                            uint8_t* stage, bool last_piece) {
  if (stage_output(p, po, last_piece)) {
    store_o_staged(p, o, f, po, s, hg, r0, c, col0, stage);
  } else if (!kSkipMidWalkStores || last_piece) {
    store_o(p, o, f, po, s, hg, r0, c, col0);
  }
}

// O rows scaled by their alpha; skipped by a warp whose rows all keep their maximum
// (alpha exactly 1: the product would change nothing).
__device__ __forceinline__ void rescale_o(float (&o)[128], float a0, float a1) {
  if (!__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) return;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] *= ((i >> 1) & 1) ? a1 : a0;
}

// Validity bits of the block's 64 entries (bit e: entry e), from the 8 words the
// producers wrote (word k: entries 8 k .. 8 k + 7 in its low byte).
__device__ __forceinline__ uint64_t block_valid_mask(const uint8_t* words) {
  const uint4 a = *reinterpret_cast<const uint4*>(words);
  const uint4 b = *reinterpret_cast<const uint4*>(words + 16);
  const uint32_t lo = a.x | (a.y << 8) | (a.z << 16) | (a.w << 24);
  const uint32_t hi = b.x | (b.y << 8) | (b.z << 16) | (b.w << 24);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Where a consumer's block n stands: the cursor of the next block, whether block n ends its
// request's piece and whether it ends the worker's walk, and block n's buffer and K tile (the
// walk both consumers share).
struct ConsumerStep {
  Cursor next;
  bool last;
  bool walk_ends;
  int buf;
  uint32_t k_tile;
};

// `L`: the shared-memory layout (its K tiles).
template <KVFormat F, typename L = Smem<F>>
__device__ __forceinline__ ConsumerStep consumer_step(const Params& p, const Work& w, const Cursor& cur, int n,
                                                      uint32_t sb) {
  ConsumerStep st;
  st.next = cur;
  cursor_advance(st.next, p, w.end_req, w.end_block);
  st.last = st.next.r != cur.r;
  st.walk_ends = st.next.r > w.end_req;
  st.buf = n & 1;
  st.k_tile = sb + L::kK + st.buf * L::kTile;
  return st;
}

// The running maximum of a row moves only when a block's maximum exceeds it by more than
// this (base 2): probabilities then stay under 2^8, harmless in fp32 and bf16 (rounding is
// relative), and most blocks leave alpha = 1, so both consumers skip rescaling O.
constexpr float kLazyRescale = 8.f;

// Reductions over the 16 accumulators of a thread's row half hf (i with (i / 2) % 2 == hf),
// as trees: short dependency chains.
__device__ __forceinline__ float row_max(const float (&x)[32], int hf) {
  float a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = fmaxf(x[4 * k + 2 * hf], x[4 * k + 2 * hf + 1]);
#pragma unroll
  for (int w = 4; w >= 1; w /= 2)
#pragma unroll
    for (int k = 0; k < w; ++k) a[k] = fmaxf(a[k], a[k + w]);
  return a[0];
}

__device__ __forceinline__ float row_sum(const float (&x)[32], int hf) {
  float a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = x[4 * k + 2 * hf] + x[4 * k + 2 * hf + 1];
#pragma unroll
  for (int w = 4; w >= 1; w /= 2)
#pragma unroll
    for (int k = 0; k < w; ++k) a[k] += a[k + w];
  return a[0];
}

template <KVFormat F, int kCluster>
__device__ __forceinline__ void consume_qk(const Params& p, const Work& w, int s, int hg, uint32_t sb, uint32_t peer,
                                           uint8_t* smem) {
  using L = Smem<F>;
  const int t = threadIdx.x;
  const int lane = t & 31;
  const int c = lane & 3;
  const int r0 = 16 * (t >> 5) + (lane >> 2);  // this thread's rows: r0, r0 + 8
  float* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha);
  float* final_s = reinterpret_cast<float*>(smem + L::kFinal);
  uint4* p_frag = reinterpret_cast<uint4*>(smem + L::kP);  // P's A fragments for WG1
  const float scale = p.scale_log2;

  stamp(t == 0, kStampQKStart);
  Cursor cur;
  cursor_enter(cur, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  load_q<F>(p, cur.r, s, hg * kRows, sb + L::kQ, sb + L::kQFull, t);
  stamp(t == 0, kStampQIssued);
  if (kCluster > 1) cluster_wait();  // (decode_kernel: Q's copies went out before it)
  stamp(t == 0, kStampQClusterWaited);
  bool q_pending = true;
  bool first = true;  // first block of a piece
  int parity = 0;     // piece parity (final_s buffer; kQFull's phase: one Q a piece)
  float o[128];
  zero(o);
  float m[2] = {kInitMax, kInitMax};
  float l[2] = {0.f, 0.f};

  for (int n = 0;; ++n) {
    const ConsumerStep st = consumer_step<F>(p, w, cur, n, sb);
    const Cursor& nx = st.next;
    const bool last = st.last;
    const int buf = st.buf;
    const uint32_t k_s = st.k_tile;

    if (q_pending) {
      const long long span_q = span_clock();
      mbar_wait(sb + L::kQFull, parity);  // (written by the copy engine: no proxy fence for wgmma)
      span_add(t == 0 && n > 0, kSpanQKWaitNextQ, span_q);
      q_pending = false;
      stamp(t == 0 && n == 0, kStampQ);
    }
    long long span_t = span_clock();
    wait_full(sb + L::kFull + 8 * buf, (n >> 1) & 1);
    stamp(t == 0 && n == 0, kStampFirstTile);
    span_add(t == 0, kSpanQKWaitTile, span_t);
    // The block's validity bits, read before QK so that their load (behind the tile writes
    // in the shared-memory queue) overlaps the product rather than starting the softmax.
    const uint64_t valid = block_valid_mask(smem + L::kValid + 32 * buf);
    span_t = span_clock();

    // S = Q K^T
    float sacc[32];
    if (!kSkipMma) {
      wgmma_fence();
      const uint64_t dq = desc_k_major_sw128(sb + L::kQ);
      const uint64_t dk = desc_k_major(k_s, kTokens);
      wgmma_m64n64k16_ss_first(sacc, dq, dk);
#pragma unroll
      for (int ks = 1; ks < Fmt<F>::kDqk / 16; ++ks)  // Q: slice ks / 4, 32 bytes a k-step inside it
        wgmma_m64n64k16_ss(sacc, dq + static_cast<uint64_t>(((ks / 4) * L::kQSlice + (ks % 4) * 32) / 16),
                           dk + static_cast<uint64_t>(ks * 2 * L::kGroupStride / 16));
      wgmma_commit();
      wgmma_wait<0>();
      pin(sacc);
    } else {
      zero(sacc);
    }
    span_add(t == 0, kSpanQK, span_t);
    span_t = span_clock();
    if (last && !st.walk_ends && !kKeepFirstQ) q_pending = true;  // WG1 fetches the next request's Q

    // Online softmax (base 2) over this thread's 2 rows x 16 entries. Invalid entries
    // get -inf; the common all-valid block skips the selects (a uniform branch).
    if (~valid != 0) {
      const uint64_t vm = valid >> (2 * c);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int col = 8 * (i >> 2) + (i & 1);
        if (!((vm >> col) & 1)) sacc[i] = -INFINITY;
      }
    }
    // A row's maximum over its quad (two shuffles) only matters when it moves the running
    // maximum, and in most blocks no value of the warp's rows exceeds it by kLazyRescale:
    // one vote then stands for the shuffles (alpha = 1, the maximum as it was).
    // scale > 0 (checked in Python): the maximum of the scaled logits is the scaled maximum.
    float mx[2] = {row_max(sacc, 0), row_max(sacc, 1)};
    const bool reduce =
        first || __any_sync(0xffffffffu, mx[0] * scale > m[0] + kLazyRescale || mx[1] * scale > m[1] + kLazyRescale);
    float alpha[2] = {1.f, 1.f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      if (reduce) {  // uniform over the warp
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
        const float mx_scaled = mx[hf] * scale;
        const bool grow = mx_scaled > m[hf] + kLazyRescale;  // false for NaN and for -inf (all masked)
        const float m_new = grow ? mx_scaled : m[hf];
        alpha[hf] = grow ? fast_exp2(m[hf] - m_new) : 1.f;
        m[hf] = m_new;
      }
#pragma unroll
      for (int i = 0; i < 32; ++i)
        if (((i >> 1) & 1) == hf) sacc[i] = fast_exp2(fmaf(sacc[i], scale, -m[hf]));
      l[hf] = l[hf] * alpha[hf] + row_sum(sacc, hf);  // this thread's 16 entries; the quad is summed at the end
    }

    // P in bf16: A fragments of the 4 k-steps (16 entries each) and the smem copy for WG1.
    uint32_t pf[16];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int e = 0; e < 4; ++e) pf[4 * ks + e] = pack_bf16x2(sacc[8 * ks + 2 * e], sacc[8 * ks + 2 * e + 1]);
    span_add(t == 0, kSpanSoftmaxMath, span_t);
    if (!first) {
      const long long span_free = span_clock();
      named_bar_sync(kBarPFree, kConsumers);
      span_add(t == 0, kSpanQKWaitPFree, span_free);
    }
    const long long span_out = span_clock();
    // WG1's thread t needs the same A fragments as this thread t: they go over as they are,
    // k-step major (a warp's 16-byte stores, and WG1's loads, are contiguous). WG1 loads them
    // into registers, so no async-proxy read of P and no proxy fence here.
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      p_frag[ks * kWarpgroup + t] = make_uint4(pf[4 * ks], pf[4 * ks + 1], pf[4 * ks + 2], pf[4 * ks + 3]);
    if (c == 0) {
      alpha_s[r0] = alpha[0];
      alpha_s[r0 + 8] = alpha[1];
    }
    named_bar_arrive(kBarPReady, kConsumers);
    span_add(t == 0, kSpanSoftmaxHandOver, span_out);
    span_add(t == 0, kSpanSoftmax, span_t);
    span_t = span_clock();

    // O[:, 0:256] = alpha O + P V (at a piece's first block O is zero: nothing to scale)
    if (!first) rescale_o(o, alpha[0], alpha[1]);
    if (!kSkipMma) {
      pin(o);
      wgmma_fence();
      const uint64_t dv = desc_n_major(k_s, kTokens);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_m64n256k16_rs_tb(o, pf + 4 * ks, dv + static_cast<uint64_t>(ks * 16));
      wgmma_commit();
      wgmma_wait<0>();
      pin(o);
      pin(pf);
    }
    span_add(t == 0, kSpanQKPV, span_t);
    release_tile<kCluster>(sb + L::kEmpty + 8 * buf, peer + L::kEmpty + 8 * buf);
    if (kCluster > 1 && st.walk_ends) cluster_arrive_release();  // done with the peer

    first = last;
    if (last) {
      span_t = span_clock();
      const PieceOut po = piece_out(p, w, cur.r);
      float f[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float sum = l[hf] + __shfl_xor_sync(0xffffffffu, l[hf], 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = r0 + 8 * hf;
        f[hf] = finish_head(p, w, po, s, hg * kRows + row, sum, m[hf], c == 0);
        if (c == 0) final_s[parity * kRows + row] = f[hf];
        m[hf] = kInitMax;
        l[hf] = 0.f;
      }
      const long long span_wait = span_clock();
      named_bar_sync(kBarPieceEnd, kConsumers);  // (past it, both consumers are done with every tile)
      span_add(t == 0, kSpanQKPieceEndWait, span_wait);
      stamp_first(t == 0, kStampFirstPieceEnd);
      stamp(t == 0, kStampStoreQK);
      const long long span_store = span_clock();
      store_piece(p, o, f, po, s, hg, r0, c, 0, smem + L::kK, st.walk_ends);
      span_add(t == 0, kSpanQKPieceEndStore, span_store);
      stamp(t == 0, kStampStoredQK);
      span_add(t == 0, kSpanQKPieceEnd, span_t);
      zero(o);
      parity ^= 1;
    }
    if (st.walk_ends) break;
    cur = nx;
  }
}

template <KVFormat F, int kCluster>
__device__ __forceinline__ void consume_pv(const Params& p, const Work& w, int s, int hg, uint32_t sb, uint32_t peer,
                                           uint8_t* smem) {
  using L = Smem<F>;
  const int t = threadIdx.x - kWarpgroup;
  const int lane = t & 31;
  const int c = lane & 3;
  const int r0 = 16 * (t >> 5) + (lane >> 2);
  const float* alpha_s = reinterpret_cast<const float*>(smem + L::kAlpha);
  const uint4* p_frag = reinterpret_cast<const uint4*>(smem + L::kP);  // WG0's A fragments of P
  const float* final_s = reinterpret_cast<const float*>(smem + L::kFinal);

  Cursor cur;
  cursor_enter(cur, p, w.begin_req, w.begin_block, w.end_req, w.end_block);
  if (kCluster > 1) cluster_wait();  // (decode_kernel)
  int parity = 0;
  float o[128];
  zero(o);

  for (int n = 0;; ++n) {
    const ConsumerStep st = consumer_step<F>(p, w, cur, n, sb);
    const Cursor& nx = st.next;
    const bool last = st.last;
    const int buf = st.buf;
    const uint32_t k_s = st.k_tile;

    long long span_t = span_clock();
    named_bar_sync(kBarPReady, kConsumers);
    span_add(t == 0, kSpanPVWaitP, span_t);
    span_t = span_clock();
    // P (WG0's A fragments of this thread's rows) and alpha into registers; WG0 may then
    // write the next block's at once.
    uint32_t pf[16];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint4 v = p_frag[ks * kWarpgroup + t];
      pf[4 * ks] = v.x;
      pf[4 * ks + 1] = v.y;
      pf[4 * ks + 2] = v.z;
      pf[4 * ks + 3] = v.w;
    }
    const float alpha0 = alpha_s[r0], alpha1 = alpha_s[r0 + 8];
    if (!last) named_bar_arrive(kBarPFree, kConsumers);
    wait_full(sb + L::kFull + 8 * buf, (n >> 1) & 1);  // (already complete: makes K visible here too)
    rescale_o(o, alpha0, alpha1);
    if (!kSkipMma) {
      pin(o);
      wgmma_fence();
      const uint64_t dv = desc_n_major(k_s + 32 * L::kGroupStride, kTokens);  // value columns 256..511
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_m64n256k16_rs_tb(o, pf + 4 * ks, dv + static_cast<uint64_t>(ks * 16));
      wgmma_commit();
      wgmma_wait<0>();
      pin(o);
      pin(pf);
    }
    span_add(t == 0, kSpanPV, span_t);
    release_tile<kCluster>(sb + L::kEmpty + 8 * buf, peer + L::kEmpty + 8 * buf);
    if (kCluster > 1 && st.walk_ends) cluster_arrive_release();  // done with the peer

    if (last) {
      span_t = span_clock();
      const PieceOut po = piece_out(p, w, cur.r);
      named_bar_sync(kBarPieceEnd, kConsumers);
      // Q is free (WG0's QK of this block is long done): the next request's copies go out
      // from here and land while both consumers store this piece. Issued in WG0's block loop,
      // their code cost every block ~50 stall cycles on WG0's softmax path (NOTES, session 47).
      if (!st.walk_ends && !kKeepFirstQ) {
        const long long span_issue = span_clock();
        load_q<F>(p, nx.r, s, hg * kRows, sb + L::kQ, sb + L::kQFull, t);
        span_add(t == 0, kSpanPVIssueNextQ, span_issue);
      }
      const float f[2] = {final_s[parity * kRows + r0], final_s[parity * kRows + r0 + 8]};
      stamp(t == 0, kStampStorePV);
      store_piece(p, o, f, po, s, hg, r0, c, 256, smem + L::kK, st.walk_ends);
      stamp(t == 0, kStampStoredPV);
      span_add(t == 0, kSpanPVPieceEnd, span_t);
      zero(o);
      parity ^= 1;
    }
    if (st.walk_ends) break;
    cur = nx;
  }
}

// kCluster = 2: launched in clusters of two CTAs along the head-group axis (grid z even).
// kAligned: every token row of the caches is 16-byte aligned (caches_aligned16).
template <KVFormat F, int kCluster, bool kAligned>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel(const __grid_constant__ Params p) {
  using L = Smem<F>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int worker = blockIdx.x;
  const int s = blockIdx.y;
  const int hg = blockIdx.z;
  stamp(threadIdx.x == 0, kStampEntry);
  const Work w = read_work(p, worker);
  // An idle worker: the whole CTA (and its cluster peer, same worker) leaves before any barrier.
  if (w.begin_req > w.end_req) return;
  stamp(threadIdx.x == 0, kStampWork);

  const uint32_t sb = smem_u32(smem);
  init_tile_barriers(sb + L::kFull, sb + L::kEmpty, kProducers, kConsumerWarps * kCluster, sb + L::kQFull);
  uint32_t peer = 0;
  if (kCluster > 1) {
    peer = peer_smem(sb, cluster_ctarank() ^ 1);
    // Each role waits (cluster_wait) once its first loads are out, before its first barrier
    // or peer access: the peer's barriers are initialized before anyone arrives on them.
    cluster_arrive_relaxed();
  } else {
    __syncthreads();
  }
  stamp(threadIdx.x == 0, kStampInit);

  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroup, 0);
  if (wg >= 2) {
    set_registers<kRegsProducer>();
    if (kCluster > 1) {
      produce_pair<F, kAligned>(p, w, s, sb, peer, smem);
      cluster_arrive_release();  // its last stores into the peer are issued
    } else {
      produce_solo<F, kAligned, 2>(p, w, s, sb, smem, 0, threadIdx.x - kConsumers);
    }
    stamp(threadIdx.x == kConsumers, kStampProducerDone);
  } else if (wg == 0) {
    set_registers<kRegsQK>();
    consume_qk<F, kCluster>(p, w, s, hg, sb, peer, smem);
    stamp(threadIdx.x == 0, kStampQKDone);
  } else {
    set_registers<kRegsPV>();
    consume_pv<F, kCluster>(p, w, s, hg, sb, peer, smem);
    stamp(threadIdx.x == kWarpgroup, kStampPVDone);
  }
  // Every thread arrived when it was done with the peer (each role above): the peer may write
  // into this CTA's tiles and arrive on its barriers until then.
  if (kCluster > 1) cluster_wait();
  stamp(threadIdx.x == 0, kStampExit);
}

}  // namespace cuda
}  // namespace jsm

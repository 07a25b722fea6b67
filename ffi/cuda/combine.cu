// The combine on CUDA: merges the partial results of requests that the plan cut into several
// pieces (docs/schedule.md, Combine), then applies the sink once. The FFI handler that checks
// the operands is combine_handler.cu.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "common/problem.h"
#include "cuda/cuda_util.cuh"
#include "cuda/combine.h"

namespace jsm {
namespace cuda {
namespace {

constexpr int kCombineThreads = 128;

// max that keeps NaN (fmaxf drops it): a NaN piece must not make a row look empty.
__device__ __forceinline__ float max_keep_nan(float a, float b) { return (b > a || b != b) ? b : a; }

// What every row's merge reads and writes: the kernels' parameters (a CombineProblem less
// what only the host uses; num_slots = batch + num_parts, the partial buffers' pieces).
struct CombineArgs {
  const float* out_accum;
  const float* lse_accum;
  const int32_t* num_splits;
  const float* attn_sink;
  int64_t sink_stride;
  int batch, s_q, h_q;
  int64_t num_slots;
  bool has_sink;
  uint16_t* out;
  float* lse;
};

// One (request r, query row s, head h) row's merge, columns col0 .. col0 + kColumns - 1 by
// this warp: kWarpsPerRow warps share a row, each adding up 512 / kWarpsPerRow columns and
// loading kInFlight pieces before adding any. The row has pieces first .. first + pieces - 1
// (pieces != 1: a one-piece row was written by the decode kernel).
template <int kWarpsPerRow, int kInFlight>
__device__ __forceinline__ void combine_row(const CombineArgs& cp, int r, int s, int h, int first, int pieces,
                                            int lane, int col0) {
  constexpr int kColumns = kDimV / kWarpsPerRow;  // this warp's columns of the row
  constexpr int kVecs = kColumns / 128;           // float4s a lane reads per piece
  const int s_q = cp.s_q, h_q = cp.h_q;
  // __restrict__ copies: without them the loads cannot use the read-only path (ld.global.nc),
  // as the stores to out and lse might alias them.
  const float* __restrict__ lse_accum = cp.lse_accum;
  uint16_t* __restrict__ out = cp.out;
  float* __restrict__ lse = cp.lse;
  // The sink's logit, loaded first: it does not depend on the pieces, and loaded where it is
  // used (last) its latency was one more global load on every row's chain.
  const float sink = cp.has_sink ? cp.attn_sink[r * cp.sink_stride + h] : 0.f;
  const bool writes_lse = lane == 0 && col0 == 0;
  const int64_t out_off = ((static_cast<int64_t>(r) * s_q + s) * h_q + h) * kDimV + col0;
  const int64_t lse_off = (static_cast<int64_t>(r) * h_q + h) * s_q + s;
  // A plan whose pieces fall outside the partial buffers (a hand-made one): NaN, and
  // nothing read out of bounds.
  if (pieces < 1 || first < 0 || static_cast<int64_t>(first) + pieces > cp.num_slots) {
    for (int c = lane; c < kColumns / 2; c += 32) reinterpret_cast<uint32_t*>(out + out_off)[c] = 0x7fc07fc0u;
    if (writes_lse) lse[lse_off] = NAN;
    return;
  }

  auto lse_of = [&](int k) { return lse_accum[(static_cast<int64_t>(first + k) * s_q + s) * h_q + h]; };

  // Lane handles columns col0 + 4*lane + 128*i (i < kVecs): coalesced float4 reads. The
  // pieces' weights are computed by one lane each, 32 at a time, and kInFlight pieces are
  // loaded before any is added (a loop that adds each piece as it arrives waits out one
  // memory latency per piece: with one block a piece, that was most of a small batch's
  // combine). The first kInFlight pieces' loads go out before the lse reductions, which they
  // do not need, and lane k keeps piece k's lse for the reductions and the first round's
  // weights: a row's chain of dependent loads is the plan, then its pieces' lse and data
  // together. The sum runs in piece order, as one piece at a time would.
  static_assert(32 % kInFlight == 0, "a batch of loads never spans two rounds of weights");
  const int64_t piece_stride = static_cast<int64_t>(s_q) * h_q * kDimV;
  const float4* src0 = reinterpret_cast<const float4*>(
      cp.out_accum + ((static_cast<int64_t>(first) * s_q + s) * h_q + h) * kDimV + col0);
  float4 v[kInFlight][kVecs];
  auto load_batch = [&](int k0) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (k0 + u < pieces) {
        const float4* src = src0 + (k0 + u) * (piece_stride / 4);
#pragma unroll
        for (int i = 0; i < kVecs; ++i) v[u][i] = src[lane + 32 * i];
      }
  };
  load_batch(0);
  const float lse_first = lane < pieces ? lse_of(lane) : -INFINITY;

  float mx = max_keep_nan(-INFINITY, lse_first);
  for (int k = lane + 32; k < pieces; k += 32) mx = max_keep_nan(mx, lse_of(k));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = max_keep_nan(mx, __shfl_xor_sync(0xffffffffu, mx, o));

  if (mx == -INFINITY) {  // every piece empty
    for (int c = lane; c < kColumns / 2; c += 32) reinterpret_cast<uint32_t*>(out + out_off)[c] = 0u;
    if (writes_lse) lse[lse_off] = INFINITY;
    return;
  }
  float sum = lane < pieces ? exp2f(lse_first - mx) : 0.f;
  for (int k = lane + 32; k < pieces; k += 32) sum += exp2f(lse_of(k) - mx);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float g = log2f(sum) + mx;

  float acc[4 * kVecs];
#pragma unroll
  for (int i = 0; i < 4 * kVecs; ++i) acc[i] = 0.f;
  float w_lane = 0.f;
  for (int k0 = 0; k0 < pieces; k0 += kInFlight) {
    if (k0 % 32 == 0) {  // a round of 32 weights starts (warp-uniform)
      const bool mine = lane < pieces - k0;
      const float l = k0 == 0 ? lse_first : (mine ? lse_of(k0 + lane) : 0.f);
      w_lane = mine ? exp2f(l - g) : 0.f;
    }
    if (k0 > 0) load_batch(k0);  // batch 0 went out before the reductions
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const float wk = __shfl_sync(0xffffffffu, w_lane, (k0 + u) & 31);
      if (k0 + u < pieces)
#pragma unroll
        for (int i = 0; i < kVecs; ++i) {
          acc[4 * i + 0] += wk * v[u][i].x;
          acc[4 * i + 1] += wk * v[u][i].y;
          acc[4 * i + 2] += wk * v[u][i].z;
          acc[4 * i + 3] += wk * v[u][i].w;
        }
    }
  }
  const float lse_nat = g * 0.69314718055994531f;
  float f = 1.f;
  if (cp.has_sink) f = 1.f / (1.f + expf(sink - lse_nat));
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    uint2 packed;
    packed.x = static_cast<uint32_t>(float_to_bf16_bits(acc[4 * i + 0] * f)) |
               (static_cast<uint32_t>(float_to_bf16_bits(acc[4 * i + 1] * f)) << 16);
    packed.y = static_cast<uint32_t>(float_to_bf16_bits(acc[4 * i + 2] * f)) |
               (static_cast<uint32_t>(float_to_bf16_bits(acc[4 * i + 3] * f)) << 16);
    reinterpret_cast<uint2*>(out + out_off)[lane + 32 * i] = packed;
  }
  if (writes_lse) lse[lse_off] = lse_nat;
}

// (request, query row, head) of row `item`.
struct RowIndex {
  int r, s, h;
};
__device__ __forceinline__ RowIndex row_index(const CombineArgs& cp, int64_t item) {
  const int64_t per_req = static_cast<int64_t>(cp.s_q) * cp.h_q;
  RowIndex x;
  x.r = static_cast<int>(item / per_req);
  const int rem = static_cast<int>(item - static_cast<int64_t>(x.r) * per_req);
  x.s = rem / cp.h_q;
  x.h = rem - x.s * cp.h_q;
  return x;
}

// Few rows (a small batch): kWarpsPerRow warps to a row, one row each, many pieces in
// flight, so that more SMs read the pieces.
template <int kWarpsPerRow, int kInFlight>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const CombineArgs cp) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kCombineThreads / 32) + (threadIdx.x >> 5);
  const int64_t item = warp / kWarpsPerRow;
  if (item >= static_cast<int64_t>(cp.s_q) * cp.h_q * cp.batch) return;
  const RowIndex x = row_index(cp, item);
  const int first = cp.num_splits[x.r];
  const int pieces = cp.num_splits[x.r + 1] - first;
  if (pieces == 1) return;  // written directly by the decode kernel
  combine_row<kWarpsPerRow, kInFlight>(cp, x.r, x.s, x.h, first, pieces, lane,
                                       static_cast<int>(warp % kWarpsPerRow) * (kDimV / kWarpsPerRow));
}

// Many rows (a large batch: most rows have one piece, written by the decode kernel): a
// resident grid whose warps walk the rows (warp w: rows w, w + W, ..., W warps in all), one
// warp a row, two pieces in flight. A warp reads the plan of its next 32 rows at once (lane
// k: row k's), so a one-piece row costs a shuffle instead of a warp's launch and a load.
__global__ void __launch_bounds__(kCombineThreads) combine_kernel_rows(const CombineArgs cp) {
  constexpr int kInFlight = 2;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kCombineThreads / 32);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kCombineThreads / 32) + (threadIdx.x >> 5);
  const int64_t rows = static_cast<int64_t>(cp.s_q) * cp.h_q * cp.batch;
  for (int64_t base = warp; base < rows; base += 32 * warps) {
    const int64_t mine = base + lane * warps;  // this lane's row of the round
    int first = 0, pieces = 1;
    if (mine < rows) {
      const int r = row_index(cp, mine).r;
      first = cp.num_splits[r];
      pieces = cp.num_splits[r + 1] - first;
    }
    for (int k = 0; k < 32; ++k) {
      const int64_t item = base + k * warps;
      if (item >= rows) break;  // (warp-uniform, as the shuffles below)
      const int first_k = __shfl_sync(0xffffffffu, first, k);
      const int pieces_k = __shfl_sync(0xffffffffu, pieces, k);
      if (pieces_k == 1) continue;  // written directly by the decode kernel
      const RowIndex x = row_index(cp, item);
      combine_row<1, kInFlight>(cp, x.r, x.s, x.h, first_k, pieces_k, lane, 0);
    }
  }
}

// Few rows: up to 4 warps a row, as many as keep the grid within one wave (these variants
// use 168 registers a thread: 8 resident warps an SM; a grid beyond one wave pays for
// its extra warps in whole waves).
template <int kWarpsPerRow, int kInFlight>
void launch_few_rows(const CombineArgs& p, int64_t rows, cudaStream_t stream) {
  constexpr int64_t kWarpsPerBlock = kCombineThreads / 32;
  const int64_t blocks = (rows * kWarpsPerRow + kWarpsPerBlock - 1) / kWarpsPerBlock;
  combine_kernel<kWarpsPerRow, kInFlight><<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(p);
}

// Many rows: as many blocks as are resident at once, at most one warp a row.
ffi::Error launch_many_rows(const CombineArgs& p, int64_t rows, int sms, cudaStream_t stream) {
  // Per SM, looked up once: the same on every device of a process (one kernel, one
  // architecture), so concurrent first calls may both look it up and store the same value.
  static std::atomic<int> resident_blocks{0};
  int per_sm = resident_blocks.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, combine_kernel_rows, kCombineThreads, 0);
    if (e != cudaSuccess) return cuda_failure("cudaOccupancyMaxActiveBlocksPerMultiprocessor(combine)", e);
    resident_blocks.store(per_sm, std::memory_order_relaxed);
  }
  constexpr int64_t kWarpsPerBlock = kCombineThreads / 32;
  const int64_t blocks = std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                           static_cast<int64_t>(std::max(per_sm, 1)) * sms);
  combine_kernel_rows<<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(p);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error launch_combine(const CombineProblem& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.s_q * p.h_q;
  if (p.out_src != p.out) {
    cudaError_t e = cudaMemcpyAsync(p.out, p.out_src, rows * kDimV * sizeof(uint16_t), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_failure("combine: copying out", e);
  }
  if (p.lse_src != p.lse) {
    cudaError_t e = cudaMemcpyAsync(p.lse, p.lse_src, rows * sizeof(float), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_failure("combine: copying lse", e);
  }
  if (rows == 0) return ffi::Error::Success();
  if (rows > 0x7fffffffLL) return invalid("combine: problem too large");
  const CombineArgs args{p.out_accum, p.lse_accum,  p.num_splits, p.attn_sink, p.sink_stride, p.batch,
                         p.s_q,       p.h_q,        static_cast<int64_t>(p.batch) + p.num_parts,
                         p.has_sink,  p.out,        p.lse};
  int sms = 0;
  JSM_RETURN_IF_ERROR(current_sm_count(&sms));
  constexpr int64_t kResidentWarpsPerSm = 8;  // of the few-rows variants
  const int64_t one_wave = kResidentWarpsPerSm * sms;
  if (rows * 4 <= one_wave) {
    launch_few_rows<4, 32>(args, rows, stream);
  } else if (rows * 2 <= one_wave) {
    launch_few_rows<2, 16>(args, rows, stream);
  } else {
    JSM_RETURN_IF_ERROR(launch_many_rows(args, rows, sms, stream));
  }
  return check_launch("combine_kernel");
}

}  // namespace cuda
}  // namespace jsm

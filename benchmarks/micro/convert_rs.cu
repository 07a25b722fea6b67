// What the few-heads kernel's S^T costs when its consumer converts the FP8 codes into wgmma's
// register A operand itself (benchmarks/NOTES.md, session 20: the `small_rs*` patches spend
// ~1,960 instructions a block on each consumer warp, 1,280 of them in conversions).
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") benchmarks/micro/convert_rs.cu -o /tmp/convert_rs
// One CTA per SM with 1 or 2 warpgroups, each on its own copy of a raw 64-token V32 tile in
// shared memory (random codes, no NaN). A block is the kernels' S^T: for each of the 9
// 16-byte chunks of a thread's two token rows, one LDS.128 a row, the conversion, 4
// m64n16k16 RS products (A fragments double-buffered, as in the patches). Modes:
//   bf16: the shipped rule (dequant4: e4m3x2 -> f16x2 -> f32 -> bf16x2, times bf16(scale));
//   f16:  e4m3x2 -> f16x2 only (exact), products in f16 (the scale applied elsewhere);
//   none: the raw words as bf16 fragments (loads and products only: the floor).
// Cycles a block per warpgroup: the median over the SMs of kReps blocks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/decode_small_rs.cuh"

using namespace jsm::cuda;

constexpr int kReps = 256;
constexpr int kPitch = 768;               // a raw row, as in the patches
constexpr int kRawBytes = 64 * kPitch;    // a tile per warpgroup
constexpr int kQBytes = 576 * 16 * 2;     // B operand, 16 heads
constexpr int kChunks = 9;                // 8 chunks of codes + the RoPE pair, as one more chunk

enum Mode { kBf16, kF16, kNone, kModes };
const char* kModeNames[kModes] = {"bf16", "f16", "none"};

// Four codes (a word) -> the two A registers of one row: codes 0, 1 and codes 2, 3.
template <int kMode>
__device__ __forceinline__ void convert(uint32_t w, uint32_t scale2, uint32_t& lo, uint32_t& hi) {
  if constexpr (kMode == kBf16) {
    dequant4(w, scale2, lo, hi);
  } else if constexpr (kMode == kF16) {
    codes_f16(w, lo, hi);
  } else {
    lo = w;
    hi = w ^ scale2;
  }
}

template <int kMode>
__global__ void __launch_bounds__(256, 1) convert_kernel(float* sink, long long* cycles) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int wg = threadIdx.x / 128;
  const int t = threadIdx.x % 128;
  // Random codes without NaN (0x7f / 0xff), Q zeros.
  for (int i = threadIdx.x; i < (kQBytes + 2 * kRawBytes) / 4; i += blockDim.x) {
    uint32_t h = (i + 1) * 2654435761u;
    h ^= h >> 13;
    reinterpret_cast<uint32_t*>(smem)[i] = i < kQBytes / 4 ? 0u : (h & 0x7e7e7e7eu);
  }
  fence_proxy_async();
  __syncthreads();
  const uint32_t q = smem_u32(smem);
  const uint32_t raw = q + kQBytes + wg * kRawBytes;
  const int warp = t >> 5, lane = t & 31, c = lane & 3, g = lane >> 2;
  const uint32_t row_a = raw + (16 * warp + g) * kPitch, row_b = row_a + 8 * kPitch;
  const uint32_t scale2 = bf16x2_splat(0.0123f);
  const uint64_t dq = desc_k_major(q, 16);
  float s[8] = {};
  long long t0 = 0;
  for (int rep = -4; rep < kReps; ++rep) {  // 4 warm-up blocks
    if (rep == 0) t0 = clock64();
    uint32_t a[2][16];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (j >= 2) wgmma_wait<1>();
      uint32_t* aj = a[j & 1];
      const uint4 ra = lds128(row_a + ((4 * j + c) ^ ((g & 1) << 2)) * 16);
      const uint4 rb = lds128(row_b + ((4 * j + c) ^ ((g & 1) << 2)) * 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        convert<kMode>(word(ra, i), scale2, aj[4 * i + 0], aj[4 * i + 2]);
        convert<kMode>(word(rb, i), scale2, aj[4 * i + 1], aj[4 * i + 3]);
      }
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < 4; ++i)
        wgmma_m64nNk16_rs<kMode == kF16, 16>(s, aj + 4 * i, dq + static_cast<uint64_t>((4 * j + i) * 2 * 16 * 16 / 16));
      wgmma_commit();
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 8; ++i) asm volatile("" : "+f"(s[i])::"memory");
  }
  const long long dt = clock64() - t0;
  float x = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) x += s[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = x;
  if (t == 0) cycles[blockIdx.x * 2 + wg] = dt;
}

template <int kMode>
void measure(int sms, int wgs, float* sink, long long* cycles) {
  const int bytes = kQBytes + 2 * kRawBytes;
  cudaFuncSetAttribute(convert_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  cudaMemset(cycles, 0, sms * 2 * sizeof(long long));
  convert_kernel<kMode><<<sms, 128 * wgs, bytes>>>(sink, cycles);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("CONVERT %s x%d: %s\n", kModeNames[kMode], wgs, cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  std::vector<long long> h(sms * 2);
  cudaMemcpy(h.data(), cycles, h.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  std::vector<long long> first(sms);
  for (int i = 0; i < sms; ++i) first[i] = h[2 * i];
  std::sort(first.begin(), first.end());
  const double per_block = static_cast<double>(first[sms / 2]) / kReps;
  std::printf("CONVERT %-4s %d warpgroup(s) a CTA: %7.1f cycles a block (36 RS k-steps) per warpgroup\n",
              kModeNames[kMode], wgs, per_block);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  long long* cycles;
  cudaMalloc(&sink, sms * 256 * sizeof(float));
  cudaMalloc(&cycles, sms * 2 * sizeof(long long));
  for (int wgs = 1; wgs <= 2; ++wgs) {
    measure<kBf16>(sms, wgs, sink, cycles);
    measure<kF16>(sms, wgs, sink, cycles);
    measure<kNone>(sms, wgs, sink, cycles);
  }
  return 0;
}

// Cycles a warpgroup's wgmma sequences take on one SM, in the shapes the decode kernels
// issue (benchmarks/NOTES.md, session 10): does a chain of products into one accumulator
// run at the tensor pipe's rate, or does each wait for the previous one's result?
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") benchmarks/micro/wgmma_chains.cu -o /tmp/wgmma_chains
// One CTA per SM, operands in shared memory (zeros).
// Each case: `kReps` times (fence, the sequence, commit, wait); cycles per repetition,
// the median over the SMs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "cuda/cuda_util.cuh"
#include "cuda/wgmma.cuh"

using namespace jsm::cuda;

constexpr int kReps = 256;
constexpr int kRows = 64;              // tokens of a K tile
constexpr int kGroupStride = kRows * 16;
constexpr int kDqk = 576;
constexpr int kTileBytes = kDqk * kRows * 2;
constexpr int kSmem = 3 * kTileBytes;  // the K tile, Q, P

enum Case {
  kQk16One,        // few-heads S^T: 36 m64n16k16 into one accumulator
  kQk16Two,        // the same k-steps alternating between two accumulators
  kQk16Four,       // ... four accumulators
  kPv16TileMajor,  // few-heads O^T: 8 tiles x 4 k-steps, a tile's k-steps back to back
  kPv16StepMajor,  // ... k-step outer, the 8 tiles inner
  kQk64One,        // 64-row S: 36 m64n64k16 into one accumulator
  kQk64Two,        // ... two accumulators
  kPv256,          // 64-row O half: 4 m64n256k16 (A and B from smem, B N-major)
  kQk64SwA,        // kQk64One with Q (A) in the 128-byte swizzled K-major layout
  kQk64SwAB,       // ... Q and the K tile both swizzled
  kQk16SwA,        // kQk16One with the K tile (A) swizzled
  kQk16SwAB,       // ... the K tile and Q both swizzled
  kPv256Rs,        // 64-row O half with P from registers (WG0's P V): 4 m64n256k16
  kCases
};
const char* kNames[kCases] = {"qk m64n16 x36, 1 acc",     "qk m64n16 x36, 2 acc",     "qk m64n16 x36, 4 acc",
                              "pv m64n16 8x4 tile-major", "pv m64n16 8x4 step-major", "qk m64n64 x36, 1 acc",
                              "qk m64n64 x36, 2 acc",     "pv m64n256 x4 (ss, tb)",   "qk m64n64 x36, A sw128",
                              "qk m64n64 x36, A+B sw128", "qk m64n16 x36, A sw128",   "qk m64n16 x36, A+B sw128", "pv m64n256 x4 (rs, tb)"};
const int kWgmmas[kCases] = {36, 36, 36, 32, 32, 36, 36, 4, 36, 36, 36, 36, 4};

// K-major operand of `rows` rows in the 128-byte swizzle layout (64-column atoms of rows x
// 128 bytes, 1024-byte aligned; 8-row groups 1024 bytes apart): k-step ks's descriptor.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t rows, int ks) {
  const uint32_t start = addr + (ks / 4) * rows * 128 + (ks % 4) * 32;
  return static_cast<uint64_t>((start >> 4) & 0x3fff) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

template <int N>
__device__ __forceinline__ void keep(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The accumulators a case uses (the others stay out of the register allocation).
template <int kCase>
__device__ __forceinline__ void keep_all(float (&a)[32], float (&b)[32], float (&c)[32], float (&d)[32], float (&o)[128]) {
  if (kCase != kPv16TileMajor && kCase != kPv16StepMajor && kCase != kPv256 && kCase != kPv256Rs) keep(a);  // (the swizzled cases too)
  if (kCase == kQk16Two || kCase == kQk16Four || kCase == kQk64Two) keep(b);
  if (kCase == kQk16Four) keep(c), keep(d);
  if (kCase == kPv16TileMajor || kCase == kPv16StepMajor || kCase == kPv256 || kCase == kPv256Rs) keep(o);
}

template <int kCase>
__global__ void __launch_bounds__(128, 1) chain_kernel(float* sink, long long* cycles) {
  extern __shared__ __align__(128) uint8_t smem[];
  for (int i = threadIdx.x; i < kSmem / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  __syncthreads();
  const uint32_t tile = smem_u32(smem);  // 1024-byte aligned (checked: the swizzled cases need it)
  if (tile % 1024 != 0) __trap();
  const uint32_t q = tile + kTileBytes;  // Q (64 or 16 rows)
  const uint32_t p_s = q + kTileBytes;   // P (64 or 16 rows)
  float a[32] = {}, b[32] = {}, c[32] = {}, d[32] = {};
  float o[128] = {};
  uint32_t pf[16] = {};  // P's A fragments (zeros) for the register form
  long long t0 = 0;
  for (int rep = -4; rep < kReps; ++rep) {  // 4 warm-up repetitions
    if (rep == 0) t0 = clock64();
    keep_all<kCase>(a, b, c, d, o);
    wgmma_fence();
    if (kCase == kQk16One || kCase == kQk16Two || kCase == kQk16Four) {
      const uint64_t dk = desc_k_major(tile, kRows), dq = desc_k_major(q, 16);
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks) {
        const int acc = kCase == kQk16One ? 0 : (kCase == kQk16Two ? ks % 2 : ks % 4);
        float* x = acc == 0 ? a : (acc == 1 ? b : (acc == 2 ? c : d));
        wgmma_m64n16k16_ss<kKMajor>(x, dk + static_cast<uint64_t>(ks * 2 * kGroupStride / 16),
                                    dq + static_cast<uint64_t>(ks * 2 * 16 * 16 / 16));
      }
    } else if (kCase == kPv16TileMajor || kCase == kPv16StepMajor) {
      const uint64_t dp = desc_k_major(p_s, 16);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int mt = kCase == kPv16TileMajor ? i / 4 : i % 8;
        const int ks = kCase == kPv16TileMajor ? i % 4 : i / 8;
        const uint64_t dv = desc_n_major(tile + mt * 8 * kGroupStride, kRows);
        wgmma_m64n16k16_ss<kNMajor>(o + 8 * mt, dv + static_cast<uint64_t>(ks * 16),
                                    dp + static_cast<uint64_t>(ks * 2 * 16 * 16 / 16));
      }
    } else if (kCase == kQk64One || kCase == kQk64Two) {
      const uint64_t dq = desc_k_major(q, kRows), dk = desc_k_major(tile, kRows);
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks)
        wgmma_m64n64k16_ss(kCase == kQk64Two && ks % 2 ? b : a, dq + static_cast<uint64_t>(ks * 2 * kGroupStride / 16),
                           dk + static_cast<uint64_t>(ks * 2 * kGroupStride / 16));
    } else if (kCase == kQk64SwA || kCase == kQk64SwAB) {
      const uint64_t dk = desc_k_major(tile, kRows);
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks)
        wgmma_m64n64k16_ss(a, desc_sw128(q, kRows, ks),
                           kCase == kQk64SwAB ? desc_sw128(tile, kRows, ks)
                                              : dk + static_cast<uint64_t>(ks * 2 * kGroupStride / 16));
    } else if (kCase == kQk16SwA || kCase == kQk16SwAB) {
      const uint64_t dq = desc_k_major(q, 16);
#pragma unroll
      for (int ks = 0; ks < kDqk / 16; ++ks)
        wgmma_m64n16k16_ss<kKMajor>(a, desc_sw128(tile, kRows, ks),
                                    kCase == kQk16SwAB ? desc_sw128(q, 16, ks)
                                                       : dq + static_cast<uint64_t>(ks * 2 * 16 * 16 / 16));
    } else if (kCase == kPv256Rs) {
      const uint64_t dv = desc_n_major(tile, kRows);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma_m64n256k16_rs_tb(o, pf + 4 * ks, dv + static_cast<uint64_t>(ks * 16));
    } else {
      const uint64_t dp = desc_k_major(p_s, kRows), dv = desc_n_major(tile + 32 * kGroupStride, kRows);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        wgmma_m64n256k16_ss_tb(o, dp + static_cast<uint64_t>(ks * 2 * kGroupStride / 16),
                               dv + static_cast<uint64_t>(ks * 16));
    }
    wgmma_commit();
    wgmma_wait<0>();
    keep_all<kCase>(a, b, c, d, o);
  }
  const long long t = clock64() - t0;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s += a[i] + b[i] + c[i] + d[i];
#pragma unroll
  for (int i = 0; i < 128; ++i) s += o[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t;
}

template <int kCase>
void measure(int sms, float* sink, long long* cycles) {
  cudaFuncSetAttribute(chain_kernel<kCase>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  chain_kernel<kCase><<<sms, 128, kSmem>>>(sink, cycles);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("%s: %s\n", kNames[kCase], cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  std::vector<long long> h(sms);
  cudaMemcpy(h.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  std::sort(h.begin(), h.end());
  const double per_rep = static_cast<double>(h[sms / 2]) / kReps;
  std::printf("WGMMA %-26s %8.1f cycles a sequence, %6.1f a wgmma\n", kNames[kCase], per_rep, per_rep / kWgmmas[kCase]);
}

template <int... kCase>
void measure_all(std::integer_sequence<int, kCase...>, int sms, float* sink, long long* cycles) {
  (measure<kCase>(sms, sink, cycles), ...);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink;
  long long* cycles;
  cudaMalloc(&sink, sms * 128 * sizeof(float));
  cudaMalloc(&cycles, sms * sizeof(long long));
  measure_all(std::make_integer_sequence<int, kCases>{}, sms, sink, cycles);
  return 0;
}

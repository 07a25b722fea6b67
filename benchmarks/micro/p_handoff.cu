// A check, not a benchmark: the P hand-off of the alternating-consumers kernel
// (benchmarks/patches/seesaw.patch, NOTES session 43). One warpgroup holds a 64 x 64 bf16 P
// as wgmma A fragments, writes it with store_fragments_64x64 and computes O = P V (64 x 256,
// fp32) twice: with A from registers (RS) and from what it wrote (SS, desc_k_major), V in a
// K tile's layout read N-major as the kernels read it. Prints whether the SS product equals
// the RS one bit for bit (the kernel's batch invariance needs it when a block's owner changes
// with the plan) and both against a float64 product on the host.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") benchmarks/micro/p_handoff.cu -o /tmp/p_handoff
// Exit status 0 when the SS product is the RS one's bits and both are within 1e-3 of the
// reference (relative to the largest |O|); 1 otherwise.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/cuda_util.cuh"
#include "cuda/wgmma.cuh"

using namespace jsm::cuda;

constexpr int kRows = 64;                  // P's rows (heads) and V's rows (tokens)
constexpr int kCols = 256;                 // the value columns one consumer multiplies
constexpr int kGroup = kRows * 16;         // bytes of one column group (8 columns)
constexpr int kVBytes = kCols / 8 * kGroup;  // V in the interleaved layout
constexpr int kPBytes = 64 / 8 * kGroup;

// Host-side bf16 (round to nearest even) and back.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// p: 64 x 64 bf16 row-major; v: 64 x 256 bf16 row-major (token, column); out: two 64 x 256
// fp32, row-major (RS, then SS).
__global__ void __launch_bounds__(128, 1) p_handoff_kernel(const uint16_t* p, const uint16_t* v, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int t = threadIdx.x;
  const int lane = t & 31;
  // V into the interleaved layout: element (row, col) at (col / 8) * kGroup + row * 16 + (col % 8) * 2.
  for (int i = t; i < kRows * kCols; i += 128) {
    const int row = i / kCols, col = i % kCols;
    *reinterpret_cast<uint16_t*>(smem + (col / 8) * kGroup + row * 16 + (col % 8) * 2) = v[i];
  }
  // This thread's A fragments of P (wgmma.cuh's accumulator layout, two elements a register).
  uint32_t a[16];
  const int r0 = 16 * (t >> 5) + (lane >> 2);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r0 + 8 * (e & 1), col = 16 * ks + 8 * (e >> 1) + 2 * (lane & 3);
      a[4 * ks + e] = p[row * 64 + col] | (static_cast<uint32_t>(p[row * 64 + col + 1]) << 16);
    }
  const uint32_t v_s = smem_u32(smem);
  const uint32_t p_s = v_s + kVBytes;
  store_fragments_64x64(p_s, a, t);
  fence_proxy_async();
  __syncthreads();

  const uint64_t dv = desc_n_major(v_s, kRows);
  const uint64_t dp = desc_k_major(p_s, kRows);
  for (int pass = 0; pass < 2; ++pass) {
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (pass == 0) {
        wgmma_m64n256k16_rs_tb(o, a + 4 * ks, dv + static_cast<uint64_t>(ks * 16));
      } else {
        wgmma_m64n256k16_ss_tb(o, dp + static_cast<uint64_t>(ks * 2 * kGroup / 16), dv + static_cast<uint64_t>(ks * 16));
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    // Accumulator i: row r0 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (t % 4) + i % 2.
#pragma unroll
    for (int i = 0; i < 128; ++i) {
      const int row = r0 + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      out[pass * kRows * kCols + row * kCols + col] = o[i];
    }
  }
}

int main() {
  std::vector<uint16_t> p(64 * 64), v(kRows * kCols);
  uint32_t h = 12345;
  auto next = [&] {  // uniform in [-1, 1)
    h = h * 1664525u + 1013904223u;
    return static_cast<float>(h >> 8) / static_cast<float>(1 << 23) - 1.f;
  };
  for (auto& x : p) x = to_bf16(std::fabs(next()));  // probabilities: in [0, 1)
  for (auto& x : v) x = to_bf16(next());
  uint16_t *dp, *dv;
  float* dout;
  const size_t out_n = 2 * kRows * kCols;
  if (cudaMalloc(&dp, p.size() * 2) || cudaMalloc(&dv, v.size() * 2) || cudaMalloc(&dout, out_n * 4)) {
    std::printf("p_handoff: cudaMalloc failed\n");
    return 1;
  }
  cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  const int smem = kVBytes + kPBytes;
  cudaFuncSetAttribute(p_handoff_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  p_handoff_kernel<<<1, 128, smem>>>(dp, dv, dout);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("p_handoff: kernel failed: %s\n", cudaGetErrorString(e));
    return 1;
  }
  std::vector<float> out(out_n);
  cudaMemcpy(out.data(), dout, out_n * 4, cudaMemcpyDeviceToHost);
  long differ = 0;
  double worst[2] = {0, 0}, scale = 0;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) {
      double ref = 0;
      for (int k = 0; k < 64; ++k) ref += double(from_bf16(p[r * 64 + k])) * double(from_bf16(v[k * kCols + c]));
      scale = std::fmax(scale, std::fabs(ref));
      const float rs = out[r * kCols + c], ss = out[kRows * kCols + r * kCols + c];
      uint32_t a, b;
      std::memcpy(&a, &rs, 4);
      std::memcpy(&b, &ss, 4);
      differ += a != b;
      worst[0] = std::fmax(worst[0], std::fabs(rs - ref));
      worst[1] = std::fmax(worst[1], std::fabs(ss - ref));
    }
  const bool ok = differ == 0 && worst[0] <= 1e-3 * scale && worst[1] <= 1e-3 * scale;
  std::printf("p_handoff: SS vs RS: %ld of %d values differ in their bits; max |O - ref| RS %.3g, SS %.3g "
              "(max |ref| %.3g): %s\n",
              differ, kRows * kCols, worst[0], worst[1], scale, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

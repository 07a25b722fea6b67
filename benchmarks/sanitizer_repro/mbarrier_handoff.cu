// Minimal kernel with the decode kernel's producer/consumer hand-off of the "valid words"
// through two mbarriers per buffer, two buffers: a producer warpgroup waits on `empty`,
// writes one word per warp (lane 0) and arrives on `full` (every thread, release); a
// consumer warpgroup waits on `full` (acquire), reads the buffer's four words as one
// 16-byte load, and each warp arrives on `empty` once (lane 0 after __syncwarp, release).
// Every access is ordered by an mbarrier phase, so a racecheck report here is about the
// pattern (the decode kernel's block_valid_mask vs its producers' valid-word stores), not
// about this code. Run:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/mbar benchmarks/sanitizer_repro/mbarrier_handoff.cu
//   compute-sanitizer --tool racecheck /tmp/mbar ; compute-sanitizer --tool synccheck /tmp/mbar
#include <cstdint>
#include <cstdio>

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__global__ void handoff(uint32_t* out, int rounds) {
  __shared__ __align__(16) uint32_t words[2][4];
  __shared__ uint64_t full[2], empty[2];
  const int t = threadIdx.x;
  if (t == 0) {
    for (int i = 0; i < 2; ++i) {
      bar_init(&full[i], 128);  // every producer thread arrives
      bar_init(&empty[i], 4);   // one arrival per consumer warp
    }
  }
  __syncthreads();
  uint32_t acc = 0;
  for (int n = 0; n < rounds; ++n) {
    const int buf = n & 1;
    if (t >= 128) {  // producer warpgroup (decode: produce_solo)
      bar_wait(&empty[buf], ((n >> 1) & 1) ^ 1);
      if ((t & 31) == 0) words[buf][(t - 128) / 32] = static_cast<uint32_t>(n * 4 + (t - 128) / 32);
      bar_arrive(&full[buf]);
    } else {  // consumer warpgroup (decode: consume_qk)
      bar_wait(&full[buf], (n >> 1) & 1);
      const uint4 w = *reinterpret_cast<const uint4*>(words[buf]);
      acc += w.x + w.y + w.z + w.w;
      __syncwarp();
      if ((t & 31) == 0) bar_arrive(&empty[buf]);
      __syncwarp();
    }
  }
  out[t] = acc;
}

int main() {
  constexpr int kRounds = 16;
  uint32_t* out;
  cudaMalloc(&out, 256 * sizeof(uint32_t));
  handoff<<<1, 256>>>(out, kRounds);
  const cudaError_t e = cudaDeviceSynchronize();
  uint32_t h[256];
  cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
  uint32_t want = 0;  // round n's words are 4n .. 4n + 3
  for (int n = 0; n < kRounds; ++n) want += 16 * n + 6;
  printf("mbarrier handoff: %s, out[5] = %u (expected %u)\n", cudaGetErrorString(e), h[5], want);
  return e == cudaSuccess && h[5] == want ? 0 : 1;
}

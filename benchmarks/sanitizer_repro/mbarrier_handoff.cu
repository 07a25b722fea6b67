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

#include "mbarrier_ops.h"

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

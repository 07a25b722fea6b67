// Minimal kernel with the few-heads kernel's hand-off of rows copied by cp.async (unaligned
// cache pages and MODEL1's scale bytes, decode_small_rs.cuh's produce_rs): a producer
// warpgroup waits on `empty`, copies 8-byte pieces from global memory into the buffer with
// cp.async and has each thread's copies arrive on `full` when they land
// (`cp.async.mbarrier.arrive.noinc`, counted among `full`'s 128 arrivals); a consumer
// warpgroup waits on `full` (acquire), reads the buffer, and each warp arrives on `empty`
// once. Every access is ordered by an mbarrier phase, so a racecheck report here is about the
// pattern (the decode kernel's LDS of a raw row vs the producer's LDGSTS), not about this code.
// Run:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/cpa benchmarks/sanitizer_repro/cp_async_handoff.cu
//   compute-sanitizer --tool racecheck /tmp/cpa ; compute-sanitizer --tool synccheck /tmp/cpa
#include <cstdint>
#include <cstdio>

#include "mbarrier_ops.h"

// Buffer rows of 16 pieces of 8 bytes; the producer's thread t copies piece t of round n's rows.
constexpr int kPieces = 128;

__global__ void handoff(const uint2* src, uint32_t* out, int rounds) {
  __shared__ __align__(16) uint2 rows[2][kPieces];
  __shared__ uint64_t full[2], empty[2];
  const int t = threadIdx.x;
  if (t == 0) {
    for (int i = 0; i < 2; ++i) {
      bar_init(&full[i], 128);  // every producer thread's copies arrive once
      bar_init(&empty[i], 4);   // one arrival per consumer warp
    }
  }
  __syncthreads();
  uint32_t acc = 0;
  for (int n = 0; n < rounds; ++n) {
    const int buf = n & 1;
    if (t >= 128) {  // producer warpgroup (decode: produce_rs, unaligned rows)
      bar_wait(&empty[buf], ((n >> 1) & 1) ^ 1);
      const int piece = t - 128;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(&rows[buf][piece])),
                   "l"(src + n * kPieces + piece)
                   : "memory");
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(&full[buf])) : "memory");
    } else {  // consumer warpgroup (decode: consume_qk_f16 / consume_pv_f16)
      bar_wait(&full[buf], (n >> 1) & 1);
      const uint2 v = rows[buf][t];
      acc += v.x + v.y;
      __syncwarp();
      if ((t & 31) == 0) bar_arrive(&empty[buf]);
      __syncwarp();
    }
  }
  if (t >= 128) asm volatile("cp.async.wait_all;\n" ::: "memory");
  out[t] = acc;
}

int main() {
  constexpr int kRounds = 16;
  uint2 host_src[kRounds * kPieces];
  for (int i = 0; i < kRounds * kPieces; ++i) host_src[i] = make_uint2(i, 1);
  uint2* src;
  uint32_t* out;
  cudaMalloc(&src, sizeof(host_src));
  cudaMalloc(&out, 256 * sizeof(uint32_t));
  cudaMemcpy(src, host_src, sizeof(host_src), cudaMemcpyHostToDevice);
  handoff<<<1, 256>>>(src, out, kRounds);
  const cudaError_t e = cudaDeviceSynchronize();
  uint32_t h[256];
  cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
  uint32_t want = 0;  // consumer thread 5 reads piece 5 of every round: (128 n + 5) + 1
  for (int n = 0; n < kRounds; ++n) want += kPieces * n + 5 + 1;
  printf("cp.async handoff: %s, out[5] = %u (expected %u)\n", cudaGetErrorString(e), h[5], want);
  return e == cudaSuccess && h[5] == want ? 0 : 1;
}

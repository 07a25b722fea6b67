// Minimal kernel with the decode kernel's producer/consumer hand-off between two warpgroups
// through named barriers: warpgroup 0 writes a shared array, arrives on barrier 1; warpgroup 1
// waits on barrier 1, reads it, arrives on barrier 2; warpgroup 0 waits on barrier 2 before
// writing again. Every access is ordered by a barrier (PTX: bar.arrive / barrier.sync order
// memory between the arriving and the waiting threads), so a racecheck report here is a
// report about the pattern, not about this code. Run:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/handoff named_barrier_handoff.cu
//   compute-sanitizer --tool racecheck /tmp/handoff ; compute-sanitizer --tool synccheck /tmp/handoff
#include <cstdio>

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__global__ void handoff(float* out, int rounds) {
  __shared__ float alpha[64];
  const int t = threadIdx.x;
  float acc = 0.f;
  for (int j = 0; j < rounds; ++j) {
    if (t < 128) {                      // warpgroup 0: the writer (decode: consume_qk)
      if (j > 0) bar_sync(2, 256);      // "P free": the reader is done with round j - 1
      if (t % 4 == 0) alpha[t / 2] = float(j + t);
      bar_arrive(1, 256);               // "P ready"
    } else {                            // warpgroup 1: the reader (decode: consume_pv)
      bar_sync(1, 256);
      acc += alpha[(t - 128) / 2 & 62];
      if (j + 1 < rounds) bar_arrive(2, 256);
    }
  }
  out[t] = acc;
}

int main() {
  float* out;
  cudaMalloc(&out, 256 * sizeof(float));
  handoff<<<1, 256>>>(out, 8);
  const cudaError_t e = cudaDeviceSynchronize();
  float h[256];
  cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
  // Thread 200 reads alpha[36], which thread 72 writes as j + 72 in round j.
  float want = 0.f;
  for (int j = 0; j < 8; ++j) want += float(j + 72);
  printf("handoff: %s, out[200] = %g (expected %g)\n", cudaGetErrorString(e), h[200], want);
  return e == cudaSuccess && h[200] == want ? 0 : 1;
}

// Small helpers shared by the CUDA handlers: error conversion, the cached
// multiprocessor count, and the handful of PTX instructions the kernels use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jsm {
namespace cuda {

namespace ffi = xla::ffi;

inline ffi::Error cuda_failure(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_sparse_mla (CUDA): ") + what + ": " + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ")");
}

// Checks the launch just made (configuration errors show up here; no sync).
inline ffi::Error check_launch(const char* kernel) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_failure(kernel, e);
  return ffi::Error::Success();
}

// Multiprocessors of the current device, cached per device id. No sync, no allocation.
inline ffi::Error current_sm_count(int* out) {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};  // 0: not looked up yet (benign race: same value)
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cuda_failure("cudaGetDevice", e);
  if (dev >= 0 && dev < kMaxDevices && cache[dev] > 0) {
    *out = cache[dev];
    return ffi::Error::Success();
  }
  int n = 0;
  e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return cuda_failure("cudaDeviceGetAttribute(MultiProcessorCount)", e);
  if (dev >= 0 && dev < kMaxDevices) cache[dev] = n;
  *out = n;
  return ffi::Error::Success();
}

// ---- PTX wrappers (device) ----

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 fills the 16 bytes with zeros
// and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Two bf16 products rounded once (round to nearest even); -0.0 addend keeps signed zeros.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Bulk copy shared -> global by the copy engine (16-byte aligned addresses and size), in
// this thread's bulk group; `bulk_wait_read` waits until the group's sources have been read
// (the shared memory may then be reused or the CTA exit; the writes land on their own).
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}

// Bulk tensor copy global -> this CTA's shared memory by the copy engine: the box of the
// 3-d tensor map at `map` (a generic address: of a __grid_constant__ parameter) at coordinates
// {c0, c1, c2} lands at `dst` and completes its bytes on the mbarrier `bar`.
__device__ __forceinline__ void tensor_load_3d(uint32_t dst, uint64_t map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// Named barriers in their non-.aligned form: a warp may reach them not yet reconverged
// (after a lane-0 branch, say), which the .aligned form (bar.sync) forbids.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A barrier that also votes: true in each of the `threads` threads when any of them passes true.
__device__ __forceinline__ bool named_bar_any(int id, int threads, bool vote) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred v, a;\n setp.ne.u32 v, %1, 0;\n barrier.red.or.pred a, %2, %3, v;\n"
      " selp.u32 %0, 1, 0, a;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(vote)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

}  // namespace cuda
}  // namespace jsm

// Thread-block-cluster primitives (sm_90): the CTA's rank, addresses in a peer CTA's
// shared memory (distributed shared memory), stores and mbarrier operations there,
// and the cluster-wide barrier.
//
// Addresses here are 32-bit shared::cluster addresses. A CTA's own shared::cta
// addresses are valid shared::cluster addresses of itself; a peer's come from
// peer_smem(). Synchronization across CTAs uses cluster scope (release/acquire).
#pragma once

#include <cstdint>

namespace jsm {
namespace cuda {

__device__ __forceinline__ int cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return static_cast<int>(r);
}

// The address in CTA `rank`'s shared memory that corresponds to this CTA's `smem_addr`.
__device__ __forceinline__ uint32_t peer_smem(uint32_t smem_addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}

__device__ __forceinline__ void st_cluster_v4(uint32_t addr, const uint4& v) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_cluster_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared::cluster.u8 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Arrive on an mbarrier of any CTA of the cluster; orders this thread's earlier writes
// (to any CTA's shared memory) before the arrival for cluster-scope acquirers.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits (on this CTA's mbarrier) for the phase with the given parity, acquiring at
// cluster scope: writes a peer CTA made before its arrival are visible afterwards.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Makes mbarrier initializations visible to the cluster (before a cluster_sync).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Generic-proxy writes to any CTA's shared memory made visible to the async proxy
// (the wgmma operand reads of the CTA that owns it).
__device__ __forceinline__ void fence_proxy_async_cluster() {
  asm volatile("fence.proxy.async.shared::cluster;\n" ::: "memory");
}

// Every thread of every CTA of the cluster (all warps converged).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace cuda
}  // namespace jsm

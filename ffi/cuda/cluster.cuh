// Thread-block-cluster primitives (sm_90): the CTA's rank, addresses in a peer CTA's
// shared memory (distributed shared memory), stores and mbarrier operations there,
// and the cluster-wide barrier.
//
// Addresses here are 32-bit shared::cluster addresses. A CTA's own shared::cta
// addresses are valid shared::cluster addresses of itself; a peer's come from
// peer_smem(). Data crosses CTAs only through st.async, whose completion the receiving
// CTA's mbarrier tracks: cluster-scope release/acquire would cost a GPU-wide memory
// barrier per arrival (MEMBAR.ALL.GPU, which also drains the thread's pending loads).
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

// Stores into a peer CTA's shared memory that complete `bytes` transactions on the
// peer's mbarrier `bar` once written (the peer's waiters then see them, no fence).
__device__ __forceinline__ void st_async_v4(uint32_t addr, const uint4& v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void st_async_u32(uint32_t addr, uint32_t v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr), "r"(v),
               "r"(bar)
               : "memory");
}

// Arrival on this CTA's mbarrier that also expects `bytes` more transactions this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Arrival on an mbarrier of any CTA of the cluster with no ordering of this thread's
// memory accesses: for "done reading" signals to the peer CTA, whose reads have completed
// (release at cluster scope would cost a MEMBAR.ALL.GPU per arrival, see above).
__device__ __forceinline__ void mbar_arrive_relaxed(uint32_t bar) {
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Makes mbarrier initializations visible to the cluster (before a cluster_sync).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The start of a cluster's life, split: every thread arrives (relaxed: thread 0's
// fence_mbarrier_init_cluster orders its barrier initializations before its arrival), may
// then issue work that touches neither barriers nor the peer (global loads, copies into
// its own shared memory), and waits (acquire) before its first barrier or peer access.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }

// The end of a cluster's life, split the same way: a thread arrives (release: its remote
// arrivals and stores into the peer are performed before) once it is done touching the peer,
// and waits before it exits, so that no CTA leaves while its peer may still write into it.
// Arriving before the output stores keeps their drain out of the release's memory barrier.
__device__ __forceinline__ void cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }

// Every thread of every CTA of the cluster (all warps converged).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace cuda
}  // namespace jsm

// Diagnostics, off in every shipped build: built with -DJSM_CTA_TIMELINE, each CTA of the
// 64-row decode kernel records when it reaches a few points of its life (SM clock cycles,
// and the GPU's nanosecond timer at entry and exit so that CTAs on different SMs can be
// lined up). benchmarks/micro/cta_timeline.cu launches the kernel and reads the records.
// Without the flag `stamp` is empty and the kernel's code is unchanged.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jsm {
namespace cuda {

enum Stamp {
  kStampEntry,          // thread 0, first instruction
  kStampWork,           // thread 0, the plan's work item read (idle CTAs stop before this)
  kStampInit,           // thread 0, barriers initialized and the cluster synchronized
  kStampQ,              // WG0, Q in shared memory (first piece)
  kStampFirstTile,      // WG0, the first K tile complete
  kStampStoreQK,        // WG0, the last piece's output stores begin
  kStampStoredQK,       //   ... and are issued
  kStampStorePV,        // WG1, the same
  kStampStoredPV,       //
  kStampProducerIssued, // pair producer, first block: its index read and its rows requested
  kStampProducerStored, //   ... its rows dequantized into both tiles, `full` arrived on
  kStampProducerDone,   // producer warpgroup, its loop left
  kStampQKDone,         // WG0, its loop left
  kStampPVDone,         // WG1, its loop left
  kStampExit,           // thread 0, after the exit cluster barrier
  kStamps
};

constexpr int kTimelineCtas = 1024;  // CTAs past this are not recorded

struct CtaTimeline {
  long long clock[kStamps];  // clock64(), 0 where not reached
  unsigned long long start_ns, end_ns;
  unsigned smid;
};

#ifdef JSM_CTA_TIMELINE
__device__ CtaTimeline g_cta_timeline[kTimelineCtas];

__device__ __forceinline__ CtaTimeline* timeline_of_this_cta() {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  return cta < kTimelineCtas ? &g_cta_timeline[cta] : nullptr;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records point `k` when `when` holds (one thread per point and CTA).
__device__ __forceinline__ void stamp(bool when, Stamp k) {
  CtaTimeline* tl = when ? timeline_of_this_cta() : nullptr;
  if (tl == nullptr) return;
  tl->clock[k] = clock64();
  if (k == kStampEntry) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    tl->smid = smid;
    tl->start_ns = global_ns();
  } else if (k == kStampExit) {
    tl->end_ns = global_ns();
  }
}

// The records of the last launches (kTimelineCtas of them, by linear CTA index), then zeroed
// when `clear` (defined beside the launches, in decode_launch.cu, whose copy of
// g_cta_timeline the kernels write).
cudaError_t copy_cta_timeline(CtaTimeline* host, bool clear);
#else
__device__ __forceinline__ void stamp(bool, Stamp) {}
#endif

}  // namespace cuda
}  // namespace jsm

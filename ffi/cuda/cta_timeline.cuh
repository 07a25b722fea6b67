// Diagnostics, off in every shipped build: built with -DJSM_CTA_TIMELINE, each CTA of the
// 64-row decode kernel (of the few-heads kernel: its start, exit and spans, its consumer in
// WG0's) records when it reaches a few points of its life (SM clock cycles,
// and the GPU's nanosecond timer at entry and exit so that CTAs on different SMs can be
// lined up). benchmarks/micro/cta_timeline.cu launches the kernel and reads the records.
// Spans add up the cycles of a phase that repeats every block (a wait, a product, the
// softmax), per CTA, with how often it ran: where a block's time goes in steady state.
// Without the flag `stamp`, `span_clock` and `span_add` are empty and the kernel's code is
// unchanged.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jsm {
namespace cuda {

enum Stamp {
  kStampEntry,          // thread 0, first instruction
  kStampWork,           // thread 0, the plan's work item read (idle CTAs stop before this)
  kStampInit,           // thread 0, barriers initialized and the cluster synchronized
  kStampQKStart,        // WG0, its registers raised (setmaxnreg), before the first cursor
  kStampQIssued,        // WG0, the first piece's Q copies issued
  kStampQClusterWaited, // WG0, past its cluster wait (pairs; alone: just after kStampQIssued)
  kStampQ,              // WG0, Q in shared memory (first piece)
  kStampFirstTile,      // WG0, the first K tile complete
  kStampFirstPieceEnd,  // WG0, the first piece's output stores begin (kept: stamp_first)
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

// Repeated phases, each measured by one thread of its role (t = 0 of the warpgroup).
enum Span {
  kSpanQKWaitTile,      // WG0: waiting for the block's K tile (`full`)
  kSpanQK,              //   its QK product, issue to completion
  kSpanSoftmax,         //   QK done -> P handed to WG1 (includes kSpanQKWaitPFree)
  kSpanQKWaitPFree,     //   waiting for WG1 to be done with the last block's P
  kSpanSoftmaxMath,     //   of the softmax: mask, maxima, exponentials, sums, bf16 packing
  kSpanSoftmaxHandOver, //   of the softmax: P and alpha stores (few-heads: proxy fence), arrive
  kSpanQKPV,            //   P handed -> its half of P V complete (rescale included)
  kSpanQKPieceEnd,      //   a piece's end: sums, lse, barrier, output stores issued
  kSpanQKPieceEndWait,  //     of it: waiting at the piece-end barrier for WG1
  kSpanQKPieceEndStore, //     of it: its output stores issued
  kSpanQKWaitNextQ,     //   a later piece's first block: waiting for its Q (copy engine)
  kSpanPVWaitP,         // WG1: waiting for WG0's P
  kSpanPV,              //   P ready -> its half of P V complete (rescale included)
  kSpanPVPieceEnd,      //   a piece's end: barrier, output stores issued
  kSpanPVIssueNextQ,    //   a piece's end: its thread 0 sends the next piece's Q copies
  kSpanProducerWaitEmpty,  // producer: waiting for a free buffer (`empty`)
  kSpanProducerStore,      //   converting and writing a block (both CTAs' tiles), `full` arrived
  kSpans
};

constexpr int kTimelineCtas = 1024;  // CTAs past this are not recorded

struct CtaTimeline {
  long long clock[kStamps];  // clock64(), 0 where not reached
  unsigned long long span_cycles[kSpans];
  unsigned span_count[kSpans];
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

// Records point `k` the first time `when` holds in the launch (the tool zeroes the records
// before the launch it reads).
__device__ __forceinline__ void stamp_first(bool when, Stamp k) {
  CtaTimeline* tl = when ? timeline_of_this_cta() : nullptr;
  if (tl != nullptr && tl->clock[k] == 0) tl->clock[k] = clock64();
}

__device__ __forceinline__ long long span_clock() { return clock64(); }

// Adds the cycles since `since` (a span_clock value) to span `k` when `when` holds. Fire and
// forget (reductions, no result awaited): the measured thread does not wait on memory.
__device__ __forceinline__ void span_add(bool when, Span k, long long since) {
  CtaTimeline* tl = when ? timeline_of_this_cta() : nullptr;
  if (tl == nullptr) return;
  atomicAdd(&tl->span_cycles[k], static_cast<unsigned long long>(clock64() - since));
  atomicAdd(&tl->span_count[k], 1u);
}

// The records of the last launches (kTimelineCtas of them, by linear CTA index), then zeroed
// when `clear` (defined beside the launches, in decode_launch.cu, whose copy of
// g_cta_timeline the kernels write).
cudaError_t copy_cta_timeline(CtaTimeline* host, bool clear);
#else
__device__ __forceinline__ void stamp(bool, Stamp) {}
__device__ __forceinline__ void stamp_first(bool, Stamp) {}
__device__ __forceinline__ long long span_clock() { return 0; }
__device__ __forceinline__ void span_add(bool, Span, long long) {}
#endif

}  // namespace cuda
}  // namespace jsm

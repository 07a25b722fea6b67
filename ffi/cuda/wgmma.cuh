// Hopper (sm_90a) primitives the warp-specialized decode kernel uses: wgmma with shared
// memory descriptors, mbarriers, the async-proxy fence and register reallocation.
//
// Shared-memory operand layout (no swizzle, "interleaved"): a tile is stored as
// [column group of 8 elements][row][8 elements], i.e. element (row, col) of a tile
// with R rows lives at byte (col / 8) * R * 16 + row * 16 + (col % 8) * 2. Every 8x8
// core matrix is then 128 contiguous bytes, which wgmma reads without bank conflicts
// and which 8 lanes writing 16 bytes each fill in one wavefront.
#pragma once

#include <cstdint>

namespace jsm {
namespace cuda {

// Descriptor of an operand whose rows are M (or N) and whose 16-element k-slices are
// two column groups: K-major, rows 16 bytes apart (core matrices of 8 rows 128 bytes
// apart: SBO), the second 8 columns one column group later (LBO = rows * 16 bytes).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t smem_addr, uint32_t rows) {
  const uint64_t lbo = (rows * 16) >> 4;
  const uint64_t sbo = 128 >> 4;
  return static_cast<uint64_t>((smem_addr >> 4) & 0x3fff) | (lbo << 16) | (sbo << 32);
}

// Descriptor of a K-major operand in the 128-byte swizzle layout (what a bulk tensor copy
// with CU_TENSOR_MAP_SWIZZLE_128B writes): 64 columns a row in 128 bytes, row r at r * 128,
// its 16-byte units permuted by XOR with r % 8; 8-row groups 1024 bytes apart (SBO); LBO
// unused. A k-step's 16 columns start 32 bytes further in the row (the hardware applies the
// XOR to the address), so `smem_addr` may point inside a 1024-byte aligned atom.
__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t smem_addr) {
  constexpr uint64_t kLbo = 1;
  constexpr uint64_t kSbo = 1024 >> 4;
  constexpr uint64_t kSwizzle128 = 1;
  return static_cast<uint64_t>((smem_addr >> 4) & 0x3fff) | (kLbo << 16) | (kSbo << 32) | (kSwizzle128 << 62);
}

// Descriptor of a B operand stored N-major in the same layout: N runs along a column
// group's 8 elements and then across column groups (SBO = rows * 16 bytes), K runs
// down the rows (8 rows of a core matrix 16 bytes apart, the next 8 rows: LBO = 128).
// Used with the transpose bit set.
__device__ __forceinline__ uint64_t desc_n_major(uint32_t smem_addr, uint32_t rows) {
  const uint64_t lbo = 128 >> 4;
  const uint64_t sbo = (rows * 16) >> 4;
  return static_cast<uint64_t>((smem_addr >> 4) & 0x3fff) | (lbo << 16) | (sbo << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to the async
// proxy (wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- mbarriers (CTA scope) ----

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Waits until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- wgmma (bf16 inputs, fp32 accumulators; operand lists written out) ----
// Accumulator i of a thread t of the warpgroup holds row 16 * (t / 32) + (t % 32) / 4
// + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 * (t % 4) + i % 2.
// The instruction's immediates by name: scale-d (0: D = A B; 1: D += A B), the factors of
// A and B (1: as they are) and the transpose bits of smem operands (0: K-major; 1:
// N-major, the transposed B of P V).
constexpr int kOverwrite = 0;   // scale-d
constexpr int kAccumulate = 1;  // scale-d
constexpr int kScaleA = 1;
constexpr int kScaleB = 1;
constexpr int kKMajor = 0;  // transpose bit
constexpr int kNMajor = 1;  // transpose bit

// Operand lists, written once: the accumulator registers of the asm strings ("{%0, ...}")
// and their constraints, 32 (m64n64) or 128 (m64n256) fp32 a thread.
#define JSM_ACC32_REGS \
  "{%0, %1, %2, %3, %4, %5, %6, %7," \
  " %8, %9, %10, %11, %12, %13, %14, %15," \
  " %16, %17, %18, %19, %20, %21, %22, %23," \
  " %24, %25, %26, %27, %28, %29, %30, %31}"
#define JSM_ACC128_REGS \
  "{%0, %1, %2, %3, %4, %5, %6, %7," \
  " %8, %9, %10, %11, %12, %13, %14, %15," \
  " %16, %17, %18, %19, %20, %21, %22, %23," \
  " %24, %25, %26, %27, %28, %29, %30, %31," \
  " %32, %33, %34, %35, %36, %37, %38, %39," \
  " %40, %41, %42, %43, %44, %45, %46, %47," \
  " %48, %49, %50, %51, %52, %53, %54, %55," \
  " %56, %57, %58, %59, %60, %61, %62, %63," \
  " %64, %65, %66, %67, %68, %69, %70, %71," \
  " %72, %73, %74, %75, %76, %77, %78, %79," \
  " %80, %81, %82, %83, %84, %85, %86, %87," \
  " %88, %89, %90, %91, %92, %93, %94, %95," \
  " %96, %97, %98, %99, %100, %101, %102, %103," \
  " %104, %105, %106, %107, %108, %109, %110, %111," \
  " %112, %113, %114, %115, %116, %117, %118, %119," \
  " %120, %121, %122, %123, %124, %125, %126, %127}"
#define JSM_ACC8(k, d) k(d[0]), k(d[1]), k(d[2]), k(d[3]), k(d[4]), k(d[5]), k(d[6]), k(d[7])
#define JSM_ACC32(k, d) JSM_ACC8(k, (d)), JSM_ACC8(k, (d + 8)), JSM_ACC8(k, (d + 16)), JSM_ACC8(k, (d + 24))
#define JSM_ACC128(k, d) JSM_ACC32(k, (d)), JSM_ACC32(k, (d + 32)), JSM_ACC32(k, (d + 64)), JSM_ACC32(k, (d + 96))
#define JSM_INOUT(x) "+f"(x)
#define JSM_OUT(x) "=f"(x)

// D(64x64, fp32) = A(64x16, smem) B(16x64, smem): the first k-step (D need not be initialized).
__device__ __forceinline__ void wgmma_m64n64k16_ss_first(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " JSM_ACC32_REGS ", %32, %33, p, %35, %36, %37, %38;\n}\n"
      : JSM_ACC32(JSM_OUT, d)
      : "l"(desc_a), "l"(desc_b), "n"(kOverwrite), "n"(kScaleA), "n"(kScaleB), "n"(kKMajor), "n"(kKMajor)
      : "memory");
}

// D(64x64, fp32) += A(64x16, smem) B(16x64, smem).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " JSM_ACC32_REGS ", %32, %33, p, %35, %36, %37, %38;\n}\n"
      : JSM_ACC32(JSM_INOUT, d)
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate), "n"(kScaleA), "n"(kScaleB), "n"(kKMajor), "n"(kKMajor)
      : "memory");
}

// D(64x256, fp32) += A(64x16, smem) B(16x256, smem), B stored N-major.
__device__ __forceinline__ void wgmma_m64n256k16_ss_tb(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " JSM_ACC128_REGS
      ", %128, %129, p, %131, %132, %133, %134;\n}\n"
      : JSM_ACC128(JSM_INOUT, d)
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate), "n"(kScaleA), "n"(kScaleB), "n"(kKMajor), "n"(kNMajor)
      : "memory");
}

// D(64x256, fp32) += A(64x16, registers) B(16x256, smem), B stored N-major.
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float* d, const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " JSM_ACC128_REGS
      ", {%128, %129, %130, %131}, %132, p, %134, %135, %136;\n}\n"
      : JSM_ACC128(JSM_INOUT, d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kAccumulate), "n"(kScaleA), "n"(kScaleB),
        "n"(kNMajor)
      : "memory");
}

// The narrow product with both operands in smem (benchmarks/micro/wgmma_chains.cu; the
// retired bf16-tile few-heads kernel's): D(64x16, fp32, 8 accumulators a thread) +=
// A(64x16, smem) B(16x16, smem). kTransA: A stored M-major (the transposed V of
// O^T = V^T P^T); B is K-major.
#define JSM_ACC8_REGS "{%0, %1, %2, %3, %4, %5, %6, %7}"

// The same shape, and N = 32 (16 accumulators a thread), with A from registers (4 a thread),
// K-major B, in f16 or bf16. One asm text per shape and type: SHAPE_TYPES, the accumulator list
// (ACC_REGS, ACC), the operands after it (TAIL) and the scale-d predicate's operand (PRED)
// are pasted in. (A string operand for the types made ptxas emit 40 more instructions in
// decode_kernel_rs.)
#define JSM_ACC16_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define JSM_ACC16(k, d) JSM_ACC8(k, (d)), JSM_ACC8(k, (d + 8))
#define JSM_WGMMA_RS(SHAPE_TYPES, ACC_REGS, ACC, TAIL, PRED, SCALE_D)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                           \
               "wgmma.mma_async.sync.aligned." SHAPE_TYPES " " ACC_REGS ", " TAIL ";\n}\n"                  \
               : ACC(JSM_INOUT, d)                                                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), SCALE_D, "n"(kScaleA), "n"(kScaleB), \
                 "n"(kKMajor)                                                                                \
               : "memory")
#define JSM_RS_TAIL_N16 "{%8, %9, %10, %11}, %12, p, %14, %15, %16"
#define JSM_RS_TAIL_N32 "{%16, %17, %18, %19}, %20, p, %22, %23, %24"
// One instance of the product per shape and type; SCALE_D is its scale-d operand.
#define JSM_WGMMA_RS_ALL(SCALE_D)                                                                       \
  static_assert(N == 16 || N == 32, "m64n16k16 or m64n32k16");                                          \
  if constexpr (N == 16 && kF16) {                                                                      \
    JSM_WGMMA_RS("m64n16k16.f32.f16.f16", JSM_ACC8_REGS, JSM_ACC8, JSM_RS_TAIL_N16, "%13", SCALE_D);    \
  } else if constexpr (N == 16) {                                                                       \
    JSM_WGMMA_RS("m64n16k16.f32.bf16.bf16", JSM_ACC8_REGS, JSM_ACC8, JSM_RS_TAIL_N16, "%13", SCALE_D);  \
  } else if constexpr (kF16) {                                                                          \
    JSM_WGMMA_RS("m64n32k16.f32.f16.f16", JSM_ACC16_REGS, JSM_ACC16, JSM_RS_TAIL_N32, "%21", SCALE_D);  \
  } else {                                                                                              \
    JSM_WGMMA_RS("m64n32k16.f32.bf16.bf16", JSM_ACC16_REGS, JSM_ACC16, JSM_RS_TAIL_N32, "%21", SCALE_D); \
  }

// D(64 x N) += A B with A from registers: N = 16 or 32, f16 (kF16) or bf16 inputs.
template <bool kF16, int N>
__device__ __forceinline__ void wgmma_m64nNk16_rs(float* d, const uint32_t* a, uint64_t desc_b) {
  JSM_WGMMA_RS_ALL("n"(kAccumulate));
}

// The same with scale-d chosen at run time: `accumulate` false gives D = A B, D's old values
// (NaN included) ignored.
template <bool kF16, int N>
__device__ __forceinline__ void wgmma_m64nNk16_rs_or_overwrite(float* d, const uint32_t* a, uint64_t desc_b,
                                                               bool accumulate) {
  const int scale_d = accumulate ? kAccumulate : kOverwrite;
  JSM_WGMMA_RS_ALL("r"(scale_d));
}
#undef JSM_WGMMA_RS_ALL
#undef JSM_WGMMA_RS
#undef JSM_RS_TAIL_N16
#undef JSM_RS_TAIL_N32

template <int kTransA>
__device__ __forceinline__ void wgmma_m64n16k16_ss(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " JSM_ACC8_REGS ", %8, %9, p, %11, %12, %13, %14;\n}\n"
      : JSM_ACC8(JSM_INOUT, d)
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate), "n"(kScaleA), "n"(kScaleB), "n"(kTransA), "n"(kKMajor)
      : "memory");
}

}  // namespace cuda
}  // namespace jsm

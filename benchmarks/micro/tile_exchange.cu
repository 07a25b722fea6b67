// How fast a cluster pair can exchange K tiles the way the 128-head kernel's producers do
// (decode_kernel.cuh, produce_pair), and what that costs a QK running beside it: the
// question of benchmarks/NOTES.md, session 14 (the tile writes cost the consumers ~580
// cycles a block; is that shared-memory bandwidth taken from QK, or the SM-to-SM network?).
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//     -I$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") benchmarks/micro/tile_exchange.cu -o /tmp/tile_exchange
// Every SM holds one CTA; CTAs pair up in clusters of two. Per block, each CTA's producer
// warpgroup writes half a tile (32 rows x 576 bf16 = 36,864 bytes, the kernel's addresses)
// into its own buffer (STS), into the peer's (st.async onto the peer's `full`), or both, or
// its own and then the peer's by bulk copies of its own (the copy engine, 512 bytes a column
// group); a consumer warp waits on `full` and releases `empty` in both CTAs, two buffers deep. With
// `qk`, a third warpgroup meanwhile repeats QK's product (36 m64n64k16, both operands in
// shared memory) and reports its own rate.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/cluster.cuh"
#include "cuda/cuda_util.cuh"
#include "cuda/wgmma.cuh"

using namespace jsm::cuda;

constexpr int kRowsTile = 64;
constexpr int kGroupStride = kRowsTile * 16;         // bytes per 8-column group
constexpr int kTile = 576 * kRowsTile * 2;           // 73,728 bytes
constexpr int kHalf = kTile / 2;                     // what each producer writes a block
constexpr int kOperands = 2 * 2 * kGroupStride;      // QK's A and B operand region (re-read)
constexpr int kBars = 2 * kTile + kOperands;         // full[2], empty[2]
constexpr int kSmem = kBars + 4 * 8;
// QK warpgroup first: wgmma needs a whole warpgroup (warps 4k .. 4k + 3), which the warps
// after a lone consumer warp would not be (an illegal instruction, session 15).
constexpr int kThreads = 128 + 128 + 32;             // QK warpgroup, producers, consumer warp
constexpr int kBlocks = 256;                         // blocks exchanged a launch
constexpr int kWarm = 16;                            // blocks before the clock starts

// kBulk: the peer's half by bulk copies of the local one. Runs: the kernel's warp instruction
// writes 8 rows of 4 column groups (4 runs of 128 bytes); kRuns256 writes 16 rows of 2 groups,
// kRuns512 32 rows of one: whether the SM-to-SM path moves longer runs faster (session 37's
// ncu put up to ~7.5 shared-memory wavefronts on each 512 bytes st.async brings in, against 4).
enum Mode { kLocal = 1, kRemote = 2, kBulk = 4, kRuns256 = 8, kRuns512 = 16 };

struct Result {
  long long exchange_cycles;  // kBlocks - kWarm blocks
  long long qk_cycles;        // qk_reps sequences of 36 products
  int qk_reps;
};

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
    exchange_kernel(int mode, bool qk, Result* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sb = smem_u32(smem);
  const int rank = cluster_ctarank();
  const uint32_t peer = peer_smem(sb, rank ^ 1);
  const uint32_t full = sb + kBars, empty = full + 16;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(full + 8 * i, 128);
      mbar_init(empty + 8 * i, 2);  // the consumer warps of both CTAs
    }
    fence_mbarrier_init_cluster();
  }
  cluster_sync();
  __shared__ volatile int exchange_done;
  if (threadIdx.x == 0) exchange_done = 0;
  __syncthreads();

  const int t = threadIdx.x - 128;  // producers 0 .. 127, the consumer warp 128 .. 159
  if (t >= 0 && t < 128) {  // producer: the kernel's rows and column groups
    const int pw = t >> 5, lane = t & 31;
    const int rows = (mode & kRuns512) ? 32 : (mode & kRuns256) ? 16 : 8;  // a warp instruction's rows
    const int slot = 32 * rank + (rows == 32 ? lane : rows == 16 ? 16 * (pw & 1) + (lane & 15) : 8 * pw + (lane & 7));
    const int q4 = lane >> 3;
    long long t0 = 0;
    const uint4 v = make_uint4(t, rank, 1, 2);
    for (int n = 0; n < kBlocks; ++n) {
      if (n == kWarm && t == 0) t0 = clock64();
      const int buf = n & 1;
      mbar_wait(empty + 8 * buf, ((n >> 1) & 1) ^ 1);
      const uint32_t tile = sb + buf * kTile + slot * 16, peer_tile = peer + buf * kTile + slot * 16;
      const uint32_t peer_full = peer + kBars + 8 * buf;
#pragma unroll
      for (int k = 0; k < 18; ++k) {
        const int g = rows == 32   ? 18 * pw + k
                      : rows == 16 ? 36 * (pw >> 1) + 18 * (lane >> 4) + k
                      : k < 16     ? 8 * (k / 2) + 2 * q4 + (k & 1)
                                   : 64 + 4 * (k - 16) + q4;
        if (mode & kLocal)
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + g * kGroupStride), "r"(v.x), "r"(v.y),
                       "r"(v.z), "r"(v.w)
                       : "memory");
        if (mode & kRemote) st_async_v4(peer_tile + g * kGroupStride, v, peer_full);
      }
      if (mode & kBulk) {  // the local half, once written, goes to the peer as 72 copies of 512 bytes
        fence_proxy_async();
        named_bar_sync(1, 128);
        if (lane == 0)
          for (int g = 18 * pw; g < 18 * pw + 18; ++g) {
            const uint32_t off = buf * kTile + g * kGroupStride + rank * (kGroupStride / 2);
            asm volatile(
                "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                    peer + off),
                "r"(sb + off), "n"(kGroupStride / 2), "r"(peer_full)
                : "memory");
          }
      }
      if (t == 0 && (mode & (kRemote | kBulk))) {
        mbar_arrive_expect_tx(full + 8 * buf, kHalf);
      } else {
        mbar_arrive(full + 8 * buf);
      }
    }
    if (t == 0) {
      out[blockIdx.x].exchange_cycles = clock64() - t0;
      exchange_done = 1;
    }
  } else if (t >= 128) {  // consumer warp: waits for each tile, frees it in both CTAs
    for (int n = 0; n < kBlocks; ++n) {
      const int buf = n & 1;
      mbar_wait(full + 8 * buf, (n >> 1) & 1);
      __syncwarp();
      if (t == 128) {
        mbar_arrive(empty + 8 * buf);
        mbar_arrive_relaxed(peer + kBars + 16 + 8 * buf);
      }
      __syncwarp();
    }
  } else if (qk) {  // threads 0 .. 127: QK's product over and over until the exchange is done (alone: 200 times)
    const uint32_t a = sb + 2 * kTile, b = a + 2 * kGroupStride;
    const uint64_t da = desc_k_major(a, kRowsTile), db = desc_k_major(b, kRowsTile);
    float acc[32];
    int reps = 0;
    const long long t0 = clock64();
    // (bounded: a producer that never finishes ends as a wrong figure, not as a hang.) The
    // warpgroup decides to stop as one, by a barrier vote (barrier 2; the producers use 1):
    // wgmma is a warpgroup instruction, and a warp that read the flag a rep later than the
    // others issued one alone and waited for it forever (the hang of sessions 16 and 38).
    while (!named_bar_any(2, 128, mode == 0 ? reps >= 200 : exchange_done || reps >= (1 << 16))) {
      wgmma_fence();
      wgmma_m64n64k16_ss_first(acc, da, db);
#pragma unroll
      for (int ks = 1; ks < 36; ++ks) wgmma_m64n64k16_ss(acc, da, db);
      wgmma_commit();
      wgmma_wait<0>();
      ++reps;
    }
    const long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) s += acc[i];
    if (threadIdx.x == 0) {
      out[blockIdx.x].qk_cycles = t1 - t0;
      out[blockIdx.x].qk_reps = s == 12345.f ? 0 : reps;  // (keeps the products)
    }
  }
  cluster_sync();  // the peer writes here until its last block
}

int main() {
  // Line by line: a case that hangs (the device stage's timeout kills the process) must not
  // take the lines of the cases before it along (session 16 got none).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int ctas = sms / 2 * 2;
  Result* out;
  cudaMalloc(&out, ctas * sizeof(Result));
  cudaFuncSetAttribute(exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const struct {
    const char* name;
    int mode;
    bool qk;
  } cases[] = {{"local writes only", kLocal, false},
               {"peer writes only (st.async)", kRemote, false},
               {"both (the kernel's pattern)", kLocal | kRemote, false},
               {"local + bulk copies to the peer", kLocal | kBulk, false},
               {"peer writes only, 256-byte runs", kRemote | kRuns256, false},
               {"peer writes only, 512-byte runs", kRemote | kRuns512, false},
               {"both, 256-byte runs", kLocal | kRemote | kRuns256, false},
               {"both, 512-byte runs", kLocal | kRemote | kRuns512, false},
               {"local writes + QK beside", kLocal, true},
               {"both + QK beside", kLocal | kRemote, true},
               {"local + bulk copies + QK beside", kLocal | kBulk, true},
               {"both, 256-byte runs + QK beside", kLocal | kRemote | kRuns256, true},
               {"both, 512-byte runs + QK beside", kLocal | kRemote | kRuns512, true},
               {"no writes, QK alone", 0, true}};
  for (const auto& c : cases) {
    cudaMemset(out, 0, ctas * sizeof(Result));
    std::printf("(case: %s)\n", c.name);
    exchange_kernel<<<ctas, kThreads, kSmem>>>(c.mode, c.qk, out);
    if (cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("%s: %s\n", c.name, cudaGetErrorString(cudaGetLastError()));
      return 1;
    }
    std::vector<Result> h(ctas);
    cudaMemcpy(h.data(), out, ctas * sizeof(Result), cudaMemcpyDeviceToHost);
    std::vector<double> per_block, per_qk;
    for (const auto& r : h) {
      per_block.push_back(static_cast<double>(r.exchange_cycles) / (kBlocks - kWarm));
      if (r.qk_reps > 0) per_qk.push_back(static_cast<double>(r.qk_cycles) / r.qk_reps / 36);
    }
    std::sort(per_block.begin(), per_block.end());
    std::sort(per_qk.begin(), per_qk.end());
    const int bytes = ((c.mode & kLocal) ? kHalf : 0) + ((c.mode & (kRemote | kBulk)) ? kHalf : 0);
    std::printf("EXCHANGE %-34s %7.0f cycles a block (%5.1f B/cycle written by an SM)", c.name, per_block[ctas / 2],
                bytes / per_block[ctas / 2]);
    if (!per_qk.empty()) std::printf(", QK %5.1f cycles a m64n64k16", per_qk[per_qk.size() / 2]);
    std::printf("\n");
  }
  return 0;
}

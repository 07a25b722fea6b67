// Launch configuration of the decode kernel (decode_kernel.cuh): which variant, the grid,
// clusters of two CTAs when every cluster is resident at once.
#include <algorithm>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "cuda/decode_kernel.cuh"
#include "cuda/decode_small_rs.cuh"

namespace jsm {
namespace cuda {
namespace {

// Per device, set up once: the shared memory opt-in of every variant and how many CTAs
// of the pair variant can be resident at once (clusters must sit on SM pairs).
struct DeviceSetup {
  bool done = false;
  int64_t pair_ctas = 0;  // 0: never use clusters on this device
};

// Launch configuration of the pair variant: clusters of two CTAs along grid z. `attr`
// must outlive the configuration (it points at it).
cudaLaunchConfig_t pair_config(dim3 grid, size_t smem, cudaStream_t stream, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 1;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 2;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Lets `kernel` use `bytes` of dynamic shared memory (over the 48 KB default).
template <typename Kernel>
ffi::Error allow_smem(Kernel kernel, int bytes) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_failure("cudaFuncSetAttribute (dynamic shared memory)", e);
}

template <KVFormat F>
ffi::Error set_up_device(DeviceSetup& d) {
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel_rs<F, kRsNarrowHeads, false>, SmemRs<F, kRsNarrowHeads>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel_rs<F, kRsNarrowHeads, true>, SmemRs<F, kRsNarrowHeads>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel_rs<F, kRsMaxHeads, false>, SmemRs<F, kRsMaxHeads>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel_rs<F, kRsMaxHeads, true>, SmemRs<F, kRsMaxHeads>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel<F, 1, false>, Smem<F>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel<F, 1, true>, Smem<F>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel<F, 2, false>, Smem<F>::kBytes));
  JSM_RETURN_IF_ERROR(allow_smem(decode_kernel<F, 2, true>, Smem<F>::kBytes));
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = pair_config(dim3(1, 1, 2), Smem<F>::kBytes, nullptr, &attr);
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, decode_kernel<F, 2, true>, &cfg);
  // A device that cannot tell runs the CTAs on their own.
  d.pair_ctas = e == cudaSuccess ? 2 * static_cast<int64_t>(clusters) : 0;
  if (e != cudaSuccess) cudaGetLastError();  // not sticky: clear it
  d.done = true;
  return ffi::Error::Success();
}

// The 32-head register-A kernel runs a call when its workers have at least this many blocks
// each on average: it wins at b = 128 (V32 s_q = 2, top-2048: 169 µs against the 64-row
// kernel's 203) and loses when a worker has a block or less (b = 1: 21.1 µs against 15.2).
// The crossover between has not been measured.
constexpr int64_t kRs32MinBlocksPerWorker = 4;

int64_t blocks_per_worker(const DecodeProblem& dp) {
  const int64_t per_request = (dp.topk + kTokens - 1) / kTokens + (dp.extra_topk + kTokens - 1) / kTokens;
  return static_cast<int64_t>(dp.batch) * per_request / std::max(dp.num_parts, 1);
}

// Few heads (tensor-parallel shards of 8 and 4): the transposed kernel of decode_small_rs.cuh,
// one CTA per (worker, query row), for 16 heads or fewer, and up to kRsMaxHeads with enough
// blocks a worker. Not for a batch-invariant plan: its results must equal those heads of a
// wider call bit for bit, and this kernel rounds differently.
bool use_small_kernel(const DecodeProblem& dp) {
  if (dp.batch_invariant) return false;
  if (dp.h_q <= kRsNarrowHeads) return true;
  return dp.h_q <= kRsMaxHeads && blocks_per_worker(dp) >= kRs32MinBlocksPerWorker;
}

template <KVFormat F, int H, bool kAligned>
ffi::Error launch_rs(const DecodeProblem& dp, const Params& p, cudaStream_t stream) {
  decode_kernel_rs<F, H, kAligned><<<dim3(dp.num_parts, dp.s_q, 1), kRsThreads, SmemRs<F, H>::kBytes, stream>>>(p);
  return check_launch("decode_kernel_rs");
}

template <KVFormat F, bool kAligned>
ffi::Error launch_variant(const DecodeProblem& dp, const Params& p, bool pairs, cudaStream_t stream) {
  if (use_small_kernel(dp)) {
    return dp.h_q <= kRsNarrowHeads ? launch_rs<F, kRsNarrowHeads, kAligned>(dp, p, stream)
                                    : launch_rs<F, kRsMaxHeads, kAligned>(dp, p, stream);
  }
  const int groups = (dp.h_q + kRows - 1) / kRows;
  if (!pairs) {
    const dim3 grid(dp.num_parts, dp.s_q, groups);
    decode_kernel<F, 1, kAligned><<<grid, kThreads, Smem<F>::kBytes, stream>>>(p);
    return check_launch("decode_kernel");
  }
  cudaLaunchAttribute attr;
  const dim3 grid(dp.num_parts, dp.s_q, (groups + 1) / 2 * 2);
  const cudaLaunchConfig_t cfg = pair_config(grid, Smem<F>::kBytes, stream, &attr);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, decode_kernel<F, 2, kAligned>, p);
  if (e != cudaSuccess) return cuda_failure("cudaLaunchKernelEx(decode_kernel, cluster of 2)", e);
  return check_launch("decode_kernel (cluster of 2)");
}

// Params::q_map for the 64-row kernels: Q as {d_qk, h_q, batch * s_q} bf16, boxes of 64
// columns x 64 heads in the 128-byte swizzle (decode_kernel.cuh, load_q). The driver's
// encoder is looked up once through the runtime (the library links no driver symbols).
ffi::Error encode_q_map(const DecodeProblem& dp, CUtensorMap* map) {
  static std::atomic<void*> encoder{nullptr};
  void* fn = encoder.load(std::memory_order_acquire);
  if (fn == nullptr) {
    cudaDriverEntryPointQueryResult found;
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr)
      return cuda_failure("cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", e);
    encoder.store(fn, std::memory_order_release);
  }
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(dp.d_qk), static_cast<cuuint64_t>(dp.h_q),
                              static_cast<cuuint64_t>(dp.batch) * dp.s_q};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(dp.d_qk) * 2,
                                 static_cast<cuuint64_t>(dp.h_q) * dp.d_qk * 2};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, kRows, 1};
  const cuuint32_t element_steps[3] = {1, 1, 1};
  const CUresult r = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<uint16_t*>(dp.q), dims, strides, box, element_steps,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "cuTensorMapEncodeTiled (Q) failed with CUresult " + std::to_string(static_cast<int>(r)));
  return ffi::Error::Success();
}

template <KVFormat F>
ffi::Error launch_format(const DecodeProblem& dp, cudaStream_t stream) {
  constexpr int kMaxDevices = 64;
  static DeviceSetup setups[kMaxDevices];
  int dev = 0;
  const cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cuda_failure("cudaGetDevice", e);
  DeviceSetup local;
  DeviceSetup& d = dev >= 0 && dev < kMaxDevices ? setups[dev] : local;
  if (!d.done) JSM_RETURN_IF_ERROR(set_up_device<F>(d));

  Params p = make_params(dp);
  if (!use_small_kernel(dp)) JSM_RETURN_IF_ERROR(encode_q_map(dp, &p.q_map));
  const int groups = (dp.h_q + kRows - 1) / kRows;
  // Pairs only when every cluster is resident at once: a second wave would cost a whole
  // kernel's time (the plan sizes workers for one CTA per SM).
  const bool pairs = groups >= 2 && static_cast<int64_t>(dp.num_parts) * dp.s_q * ((groups + 1) / 2 * 2) <= d.pair_ctas;
  return caches_aligned16(dp) ? launch_variant<F, true>(dp, p, pairs, stream)
                              : launch_variant<F, false>(dp, p, pairs, stream);
}

}  // namespace

ffi::Error launch_decode(const DecodeProblem& dp, cudaStream_t stream) {
  if (dp.format == KVFormat::kV32) return launch_format<KVFormat::kV32>(dp, stream);
  return launch_format<KVFormat::kModel1>(dp, stream);
}

#ifdef JSM_CTA_TIMELINE
cudaError_t copy_cta_timeline(CtaTimeline* host, bool clear) {
  cudaError_t e = cudaMemcpyFromSymbol(host, g_cta_timeline, sizeof(g_cta_timeline));
  void* records = nullptr;
  if (e == cudaSuccess && clear) e = cudaGetSymbolAddress(&records, g_cta_timeline);
  if (e == cudaSuccess && clear) e = cudaMemset(records, 0, sizeof(g_cta_timeline));
  return e;
}
#endif

}  // namespace cuda
}  // namespace jsm

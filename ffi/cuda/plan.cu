// jsm_plan on CUDA: the split-KV schedule (docs/schedule.md) computed on the device, so a
// plan depends on device-resident lengths without any host round trip.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/problem.h"
#include "common/split_plan.h"
#include "cuda/cuda_util.cuh"
#include "handlers.h"

namespace jsm {
namespace cuda {
namespace {

constexpr int kPlanThreads = 256;
// Requests whose block counts are staged in shared memory (beyond: read from global).
constexpr int kPlanSmemRequests = 12 * 1024;

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const int32_t* __restrict__ topk_length,
                                                            const int32_t* __restrict__ extra_topk_length, int batch,
                                                            int topk, int extra_topk, int num_parts, int used_parts,
                                                            bool batch_invariant,
                                                            int32_t* __restrict__ sched,
                                                            int32_t* __restrict__ num_splits) {
  extern __shared__ int32_t blocks_smem[];
  const bool staged = batch <= kPlanSmemRequests;
  auto blocks_from_global = [&](int i) {
    return main_blocks(clamp_length(topk_length[i], topk)) + extra_blocks(clamp_length(extra_topk_length[i], extra_topk));
  };
  if (staged) {
    for (int i = threadIdx.x; i < batch; i += blockDim.x) blocks_smem[i] = blocks_from_global(i);
  }
  // Workers beyond the device-fitted count stay empty.
  for (int w = used_parts + static_cast<int>(threadIdx.x); w < num_parts; w += blockDim.x) {
    set_empty_worker(sched + static_cast<int64_t>(w) * kSchedFields, batch);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (staged) {
      build_plan(batch_invariant, batch, used_parts, [&](int i) { return static_cast<int>(blocks_smem[i]); }, sched,
                 num_splits);
    } else {
      build_plan(batch_invariant, batch, used_parts, blocks_from_global, sched, num_splits);
    }
  }
}

ffi::Error plan_impl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::S32> extra_topk_length,
                     int64_t topk, int64_t extra_topk, int64_t num_parts, bool fit_to_device, int64_t parts_divisor,
                     bool batch_invariant, ffi::Result<ffi::Buffer<ffi::S32>> sched,
                     ffi::Result<ffi::Buffer<ffi::S32>> num_splits) {
  auto td = topk_length.dimensions();
  if (td.size() != 1) return invalid("plan: topk_length must have rank 1, got " + dims_str(td));
  const int64_t batch = td[0];
  JSM_RETURN_IF_ERROR(check_plan_attrs(batch, topk, extra_topk, num_parts, fit_to_device, batch_invariant));
  JSM_RETURN_IF_ERROR(expect_dims("extra_topk_length", extra_topk_length, {batch}));
  JSM_RETURN_IF_ERROR(expect_dims("sched", *sched, {num_parts, kSchedFields}));
  JSM_RETURN_IF_ERROR(expect_dims("num_splits", *num_splits, {batch + 1}));
  int64_t used = num_parts;
  if (fit_to_device) {
    int sms = 0;
    JSM_RETURN_IF_ERROR(current_sm_count(&sms));
    used = fitted_parts(num_parts, sms, parts_divisor);
  }
  const size_t smem = batch <= kPlanSmemRequests ? static_cast<size_t>(batch) * sizeof(int32_t) : 0;
  plan_kernel<<<1, kPlanThreads, smem, stream>>>(topk_length.typed_data(), extra_topk_length.typed_data(),
                                                 static_cast<int>(batch), static_cast<int>(topk),
                                                 static_cast<int>(extra_topk), static_cast<int>(num_parts),
                                                 static_cast<int>(used), batch_invariant, sched->typed_data(),
                                                 num_splits->typed_data());
  return check_launch("plan_kernel");
}

}  // namespace

int64_t parts_fitted_to_current_gpu(int64_t num_parts, int64_t parts_divisor) {
  int sms = 0;
  return current_sm_count(&sms).success() ? fitted_parts(num_parts, sms, parts_divisor) : 0;
}

}  // namespace cuda
}  // namespace jsm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmPlanCuda, jsm::cuda::plan_impl,
                              jsm::bind_plan(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

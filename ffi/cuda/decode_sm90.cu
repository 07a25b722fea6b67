// jsm_decode on CUDA (sm_90a): checks the operands and launches the decode kernel
// (decode_launch.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode_common.cuh"
#include "handlers.h"

namespace jsm {
namespace cuda {
namespace {

ffi::Error decode_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                       ffi::Buffer<ffi::S32> topk_length, ffi::AnyBuffer extra_kv,
                       ffi::Buffer<ffi::S32> extra_indices, ffi::Buffer<ffi::S32> extra_topk_length,
                       ffi::Buffer<ffi::F32> attn_sink, ffi::Buffer<ffi::S32> sched,
                       ffi::Buffer<ffi::S32> num_splits, float sm_scale, int32_t kv_format, int64_t page_size,
                       int64_t extra_page_size, bool has_sink, bool batch_invariant,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::F32>> out_accum,
                       ffi::Result<ffi::Buffer<ffi::F32>> lse_accum) {
  DecodeProblem dp;
  JSM_RETURN_IF_ERROR(make_decode_problem(q, kv, indices, topk_length, extra_kv, extra_indices, extra_topk_length,
                                          attn_sink, sched, num_splits, sm_scale, kv_format, page_size,
                                          extra_page_size, has_sink, batch_invariant, out, lse, out_accum, lse_accum,
                                          &dp));
  if (dp.batch == 0 || dp.s_q == 0 || dp.h_q == 0 || dp.num_parts == 0) return ffi::Error::Success();
  if (reinterpret_cast<uintptr_t>(dp.q) % 16 != 0) return invalid("CUDA decode: q must be 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(dp.kv) % 8 != 0 || (dp.extra_topk > 0 && reinterpret_cast<uintptr_t>(dp.extra_kv) % 8 != 0))
    return invalid("CUDA decode: kv caches must be 8-byte aligned");
  if (dp.s_q > 65535 || (dp.h_q + kRows - 1) / kRows > 65535)
    return invalid("CUDA decode: s_q or h_q too large for the launch grid");
  return launch_decode(dp, stream);
}

}  // namespace
}  // namespace cuda
}  // namespace jsm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDecodeCuda, jsm::cuda::decode_impl,
                              jsm::bind_decode(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
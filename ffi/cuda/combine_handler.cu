// jsm_combine on CUDA: checks the operands and launches the combine (combine.cu).
#include <cuda_runtime.h>

#include "common/problem.h"
#include "cuda/combine.h"
#include "handlers.h"

namespace jsm {
namespace cuda {
namespace {

ffi::Error combine_impl(cudaStream_t stream, ffi::AnyBuffer out_in, ffi::Buffer<ffi::F32> lse_in,
                        ffi::Buffer<ffi::F32> out_accum, ffi::Buffer<ffi::F32> lse_accum,
                        ffi::Buffer<ffi::S32> num_splits, ffi::Buffer<ffi::F32> attn_sink, bool has_sink,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  CombineProblem p;
  JSM_RETURN_IF_ERROR(make_combine_problem(out_in, lse_in, out_accum, lse_accum, num_splits, attn_sink, has_sink,
                                           out, lse, &p));
  return launch_combine(p, stream);
}

}  // namespace
}  // namespace cuda
}  // namespace jsm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCombineCuda, jsm::cuda::combine_impl,
                              jsm::bind_combine(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

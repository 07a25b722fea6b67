// The XLA FFI handler symbols this module exports: one per (target, platform).
// Target names seen from Python: jsm_plan, jsm_decode, jsm_combine.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmPlanCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDecodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCombineCpu);

#ifdef JSM_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmPlanCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCombineCuda);

namespace jsm {
namespace cuda {
// The worker count the CUDA plan handler's fit gives on the calling thread's current device
// (fitted_parts with its SM count); 0 where there is none. Python asks it while tracing
// (plan_decode without length arrays).
int64_t parts_fitted_to_current_gpu(int64_t num_parts, int64_t parts_divisor);
}  // namespace cuda
}  // namespace jsm
#endif

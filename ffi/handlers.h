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
// The SM count the CUDA plan handler fits its workers to, of the calling thread's current
// device; 0 where there is none. Python asks it while tracing (plan_decode without lengths).
int sm_count_for_planning();
}  // namespace cuda
}  // namespace jsm
#endif

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
#endif

// The combine's launch (combine.cu), shared by its FFI handler (combine_handler.cu) and the
// programs that run the CUDA kernels without JAX (benchmarks/sanitizer_repro/).
#pragma once

#include <cuda_runtime.h>

#include "common/problem.h"

namespace jsm {
namespace cuda {

// Copies out_src / lse_src into out / lse where they differ, then merges every row that the
// plan cut into several pieces; `p` is checked (make_combine_problem).
ffi::Error launch_combine(const CombineProblem& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace jsm

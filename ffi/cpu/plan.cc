// CPU handler of jsm_plan: runs the shared planner over the length arrays.
#include "common/problem.h"

namespace jsm {
namespace {

ffi::Error PlanCpu(ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::S32> extra_topk_length, int64_t topk,
                   int64_t extra_topk, int64_t num_parts, bool fit_to_device, int64_t /*parts_divisor*/,
                   bool batch_invariant, ffi::Result<ffi::Buffer<ffi::S32>> sched,
                   ffi::Result<ffi::Buffer<ffi::S32>> num_splits) {
  const int64_t b = topk_length.element_count();
  JSM_RETURN_IF_ERROR(check_plan_attrs(b, topk, extra_topk, num_parts, fit_to_device, batch_invariant));
  JSM_RETURN_IF_ERROR(expect_dims("extra_topk_length", extra_topk_length, {b}));
  JSM_RETURN_IF_ERROR(expect_dims("sched", *sched, {num_parts, kSchedFields}));
  JSM_RETURN_IF_ERROR(expect_dims("num_splits", *num_splits, {b + 1}));
  const int32_t* lens = topk_length.typed_data();
  const int32_t* extra_lens = extra_topk_length.typed_data();
  const int k = static_cast<int>(topk), ek = static_cast<int>(extra_topk);
  auto blocks_of = [&](int i) {
    return main_blocks(clamp_length(lens[i], k)) + extra_blocks(clamp_length(extra_lens[i], ek));
  };
  build_plan(batch_invariant, static_cast<int>(b), static_cast<int>(num_parts), blocks_of, sched->typed_data(),
             num_splits->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jsm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmPlanCpu, jsm::PlanCpu, jsm::bind_plan(xla::ffi::Ffi::Bind()));

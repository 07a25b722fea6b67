// nanobind module: hands the FFI handlers to Python as capsules and reports
// how the extension was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <vector>

#include "common/split_plan.h"
#include "handlers.h"

namespace nb = nanobind;

namespace {

// Whether the plan of `batch` requests with full lists (every length topk / extra_topk) over
// `num_parts` workers cuts a request into several pieces: the plan handlers' planner, run here.
// With none, the decode writes every out/lse row itself and the combine has nothing to do.
bool full_lists_plan_splits(bool batch_invariant, int batch, int topk, int extra_topk, int num_parts) {
  const int blocks = jsm::main_blocks(topk) + jsm::extra_blocks(extra_topk);
  std::vector<int32_t> sched(static_cast<size_t>(num_parts) * jsm::kSchedFields), num_splits(batch + 1);
  jsm::build_plan(batch_invariant, batch, num_parts, [&](int) { return blocks; }, sched.data(), num_splits.data());
  for (int i = 0; i < batch; ++i)
    if (num_splits[i + 1] - num_splits[i] != 1) return true;
  return false;
}

nb::capsule as_capsule(XLA_FFI_Handler* handler) { return nb::capsule(reinterpret_cast<void*>(handler)); }

nb::list split_archs(const char* csv) {
  nb::list out;
  std::string s(csv), item;
  for (char c : s) {
    if (c == ',') {
      if (!item.empty()) out.append(item);
      item.clear();
    } else {
      item.push_back(c);
    }
  }
  if (!item.empty()) out.append(item);
  return out;
}

}  // namespace

NB_MODULE(_jax_sparse_mla, m) {
  m.def("cpu_registrations", [] {
    nb::dict d;
    d["jsm_plan"] = as_capsule(JsmPlanCpu);
    d["jsm_decode"] = as_capsule(JsmDecodeCpu);
    d["jsm_combine"] = as_capsule(JsmCombineCpu);
    return d;
  });
  m.def("cuda_registrations", [] {
    nb::dict d;
#ifdef JSM_WITH_CUDA
    d["jsm_plan"] = as_capsule(JsmPlanCuda);
    d["jsm_decode"] = as_capsule(JsmDecodeCuda);
    d["jsm_combine"] = as_capsule(JsmCombineCuda);
#endif
    return d;
  });
  // The batch-invariant plan's worker count is a static shape: Python sizes it from these.
  m.attr("CHUNK_BLOCKS") = jsm::kChunkBlocks;
  m.attr("BLOCK_ENTRIES") = jsm::kBlockEntries;
  m.def("max_chunks", [](int topk, int extra_topk) { return jsm::max_chunks(topk, extra_topk); });
  m.def("invariant_parts_needed", [](int64_t batch, int topk, int extra_topk) {
    return jsm::invariant_parts_needed(batch, topk, extra_topk);
  });
  m.def("full_lists_plan_splits", &full_lists_plan_splits);
  m.def("cuda_fitted_parts", [](int64_t num_parts, int64_t parts_divisor) -> int64_t {
#ifdef JSM_WITH_CUDA
    return jsm::cuda::parts_fitted_to_current_gpu(num_parts, parts_divisor);
#else
    return 0;
#endif
  });
  m.def("build_info", [] {
    nb::dict d;
    d["jaxlib"] = JSM_JAXLIB_VERSION;
#ifdef JSM_WITH_CUDA
    d["cuda"] = true;
#else
    d["cuda"] = false;
#endif
    d["cuda_archs"] = split_archs(JSM_CUDA_ARCHS);
    return d;
  });
}

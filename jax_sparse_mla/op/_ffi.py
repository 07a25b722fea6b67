"""Loads the compiled extension once and registers its XLA FFI targets."""

from __future__ import annotations

import jax

from jax_sparse_mla import _jax_sparse_mla as _ext

PLAN_TARGET = "jsm_plan"
DECODE_TARGET = "jsm_decode"
COMBINE_TARGET = "jsm_combine"
# Custom-call names a `jax.export` user must list in `disabled_checks`.
TARGETS = (PLAN_TARGET, DECODE_TARGET, COMBINE_TARGET)
# Batch-invariant plans (split_plan.h): blocks per chunk, max_chunks(topk, extra_topk) (the
# chunks of the longest request a call can hold) and invariant_parts_needed(b, topk,
# extra_topk), the fewest workers such a plan can have: 1 + b * (max_chunks - 1).
CHUNK_BLOCKS = int(_ext.CHUNK_BLOCKS)
max_chunks = _ext.max_chunks
invariant_parts_needed = _ext.invariant_parts_needed
# Whether the plan of full-length lists cuts a request into pieces (split_plan.h's planner run
# while tracing): full_lists_plan_splits(batch_invariant, b, topk, extra_topk, num_parts).
full_lists_plan_splits = _ext.full_lists_plan_splits
# The worker count the CUDA plan handler's fit gives on this thread's current GPU:
# cuda_fitted_parts(num_parts, parts_divisor); 0 without a GPU or CUDA handlers.
cuda_fitted_parts = _ext.cuda_fitted_parts


def _register() -> bool:
    for name, capsule in _ext.cpu_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    cuda = _ext.cuda_registrations()
    for name, capsule in cuda.items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return bool(cuda)


CUDA_BUILT = _register()


def extension_build_info() -> dict:
    """How the extension was built: jaxlib headers, CUDA handlers (`cuda`), their archs."""
    info = dict(_ext.build_info())
    info["cuda_archs"] = list(info["cuda_archs"])
    return info

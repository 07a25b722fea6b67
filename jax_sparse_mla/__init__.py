"""jax_sparse_mla: DeepSeek-style sparse MLA decoding on FP8 paged caches, for JAX.

Public API only; see README.md and docs/ for the contract.
"""

__version__ = "0.1.0"

from jax_sparse_mla.formats import KVFormat, dequantize_kv, quantize_kv, write_kv
from jax_sparse_mla.op import _ffi
from jax_sparse_mla.op._ffi import TARGETS as EXPORT_CUSTOM_CALL_TARGETS
from jax_sparse_mla.op.decode import export_disabled_checks, sparse_mla_decode
from jax_sparse_mla.op.plan import DecodeConfig, DecodePlan, default_num_parts, plan_decode


def build_info() -> dict:
    """How the extension was built: jaxlib headers, CUDA handlers (`cuda`), their archs, and this
    package's version. Not whether a GPU is there to run them: `python -m jax_sparse_mla info`
    says both."""
    return {**_ffi.extension_build_info(), "version": __version__}


__all__ = [
    "EXPORT_CUSTOM_CALL_TARGETS",
    "DecodeConfig",
    "DecodePlan",
    "KVFormat",
    "build_info",
    "default_num_parts",
    "dequantize_kv",
    "export_disabled_checks",
    "plan_decode",
    "quantize_kv",
    "sparse_mla_decode",
    "write_kv",
]

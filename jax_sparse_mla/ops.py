"""`jax_sparse_mla.ops`, the old public path of the op's API (kept for code that imports it, such as
FlashMLA's side-by-side harness): the names now defined in `op/plan.py` and `op/decode.py`."""

from jax_sparse_mla.op.decode import export_disabled_checks, sparse_mla_decode
from jax_sparse_mla.op.plan import DecodeConfig, DecodePlan, default_config, default_num_parts, plan_decode

__all__ = ["DecodeConfig", "DecodePlan", "default_config", "default_num_parts", "export_disabled_checks",
           "plan_decode", "sparse_mla_decode"]

"""The op and its transformations: validation and the public entry points (`decode.py`, `plan.py`),
the one declaration of the decode call (`_operands.py`), the FFI calls (`_kernel.py`, `_ffi.py`),
vmap (`_batching.py`) and the sharding rule (`_partitioning.py`). Public through `jax_sparse_mla`."""

"""`jax_sparse_mla.nnx`, the public path of `jax_sparse_mla.serving.nnx` (the same module)."""

import sys

from jax_sparse_mla.serving import nnx

sys.modules[__name__] = nnx

"""`jax_sparse_mla.sharding`, the public path of `jax_sparse_mla.serving.sharding` (the same module)."""

import sys

from jax_sparse_mla.serving import sharding

sys.modules[__name__] = sharding

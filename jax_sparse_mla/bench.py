"""`jax_sparse_mla.bench`, the public path of `jax_sparse_mla.apps.bench` (the same module)."""

import sys

from jax_sparse_mla.apps import bench

sys.modules[__name__] = bench

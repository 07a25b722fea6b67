"""Shared test helpers, one module per kind: `tolerances` (docs/numerics.md), `conformance`
(FlashMLA's vectors), `np_formats` and `np_reference` (independent NumPy implementations of the
cache formats and of the op, in float64), `cases` (random cases), `schedule` (block counts) and `layouts` (multi-device
layouts and the compiled-program check for collectives). Their public names are re-exported here.

The NumPy code deliberately shares nothing with ``jax_sparse_mla``: it follows docs/formats.md
and docs/numerics.md directly.
"""

from tests.utils.cases import SOFTEN_SHIFT, fresh_rng, make_case, random_keys, soften, stale_lengths_case
from tests.utils.conformance import CONFORMANCE_DIR, conformance_files, conformance_kwargs, load_conformance
from tests.utils.layouts import collectives, largest_divisor, mesh_layouts
from tests.utils.schedule import BLOCK_ENTRIES, request_blocks
from tests.utils.np_formats import (
    BF16,
    FP8,
    fmt_name,
    np_cache_to_rows,
    np_dequantize_kv,
    np_dequantize_tokens,
    np_quantize_kv,
    np_quantize_tokens,
    np_rows_to_cache,
)
from tests.utils.np_reference import np_logit_sensitivity, np_sparse_mla_decode, valid_mask
from tests.utils.paths import REPO_ROOT
from tests.utils.tolerances import (
    LSE_ATOL,
    LSE_RTOL,
    OUT_ATOL,
    OUT_COS_DIFF,
    OUT_RTOL,
    assert_lse_close,
    assert_lse_shifted,
    assert_out_agree,
    assert_out_close,
    cosine_difference,
    out_of_tolerance,
)

"""The one declaration of the decode call: its operands, their order and sharding factors, its
results, and its static attributes.

`DecodeOperands` fixes the names and the positional order in which the operands reach the
`jsm_decode` FFI call (`bind_decode` in ffi/common/problem.h binds the same order; a test checks
it), the vmap rule (`_batching.py`) and the sharding rule (`_partitioning.py`). `FACTORS` names
every operand's dims for the Shardy rule, and from it `sharding.py` builds its specs, so adding
an operand is one field here plus its factors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec

from jax_sparse_mla.formats import KVFormat


class DecodeOperands(NamedTuple):
    """The operands of one decode, in FFI order. The plan arrays come last and are None when the
    caller passed no plan (the core then plans for the shapes it runs on)."""

    q: Any
    kv_cache: Any
    indices: Any
    topk_length: Any
    extra_kv_cache: Any
    extra_indices: Any
    extra_topk_length: Any
    attn_sink: Any
    sched: Any = None
    num_splits: Any = None

    def given(self) -> tuple:
        """The operands present, in order (what the wrappers receive positionally)."""
        return tuple(self) if self.sched is not None else tuple(self)[:len(USER_OPERANDS)]


# The plan arrays are made by plan_decode; the others are sparse_mla_decode's array arguments.
PLAN_OPERANDS = ("sched", "num_splits")
USER_OPERANDS = tuple(name for name in DecodeOperands._fields if name not in PLAN_OPERANDS)
RESULTS = ("out", "lse")

# Factors of the Shardy rule, one letter per dim. `REQUESTS` and `HEADS` may be split over
# devices; `CACHE_BLOCKS` (each cache's first dim) only by the shard_map helpers; the rest stay
# replicated.
REQUESTS, HEADS, CACHE_BLOCKS = "b", "h", ("n", "m")
FACTORS = DecodeOperands(
    q="b s h d", kv_cache="n p c", indices="b s k", topk_length="b", extra_kv_cache="m r e",
    extra_indices="b s j", extra_topk_length="b", attn_sink="h", sched="w f", num_splits="t")
# attn_sink under vmap of a mapped sink: one row per request.
SINK_PER_REQUEST_FACTORS = "b h"
RESULT_FACTORS = dict(out="b s h v", lse="b h s")


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """Everything static about one decode call (hashable: it keys the wrapper caches)."""

    sm_scale: float
    fmt: KVFormat
    page_size: int
    extra_page_size: int
    has_sink: bool
    has_extra: bool
    # attn_sink is [b, h_q] (one row per request) instead of [h_q]: vmap of a mapped sink.
    sink_per_request: bool
    # The worker count of a plan the caller passed (its arrays are then operands);
    # None: the core plans for the shapes it sees (per shard, per folded batch).
    plan_parts: int | None
    # Plans (passed or re-made per shard / folded batch) are batch-invariant ones.
    batch_invariant: bool
    # No length arrays were passed: a re-made plan follows from the shapes (DecodePlan.unsplit).
    full_lists: bool = False
    # A passed plan's `unsplit`: whoever swaps the plan's arrays in the operands swaps it too.
    plan_unsplit: bool = False

    def ffi_attributes(self) -> dict:
        """The attributes of the `jsm_decode` call, in `bind_decode`'s order."""
        return dict(sm_scale=np.float32(self.sm_scale), kv_format=np.int32(self.fmt.code),
                    page_size=np.int64(self.page_size), extra_page_size=np.int64(self.extra_page_size),
                    has_sink=bool(self.has_sink), batch_invariant=bool(self.batch_invariant))

    def factors(self) -> DecodeOperands:
        """The Shardy factors of this call's operands (plan entries None without a plan)."""
        sink = SINK_PER_REQUEST_FACTORS if self.sink_per_request else FACTORS.attn_sink
        with_plan = self.plan_parts is not None
        return FACTORS._replace(attn_sink=sink, sched=FACTORS.sched if with_plan else None,
                                num_splits=FACTORS.num_splits if with_plan else None)


def partition_spec(factors: str, axes: dict) -> PartitionSpec:
    """The PartitionSpec of an operand or result with these factors, each factor split over the
    mesh axes `axes` gives it (a tuple, or absent: replicated)."""
    dims = [None if not axes.get(f) else axes[f][0] if len(axes[f]) == 1 else axes[f] for f in factors.split()]
    while dims and dims[-1] is None:
        dims.pop()
    return PartitionSpec(*dims)

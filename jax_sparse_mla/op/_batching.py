"""vmap of `sparse_mla_decode`: mapped dims fold into the request batch, one decode runs.

q `[n, b, ...]` becomes `[n*b, ...]` (indices and lengths likewise); mapped caches are stacked
into one with each element's indices shifted onto its part; a mapped `attn_sink` becomes one
sink row per folded request (the FFI takes `[b, h_q]` sinks for that). Plans are re-made for
the folded batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla.op._kernel import plan_for
from jax_sparse_mla.op._operands import DecodeOperands, DecodeStatic
from jax_sparse_mla.op._partitioning import partitionable

_INT32_MAX = int(np.iinfo(np.int32).max)


@functools.lru_cache(maxsize=None)
def batchable(static: DecodeStatic):
    @jax.custom_batching.custom_vmap
    def decode(*ops):
        return partitionable(static)(*ops)

    @decode.def_vmap
    def rule(axis_size, in_batched, *ops):
        return _fold_batch(static, axis_size, in_batched, ops)

    return decode


def _stack_caches(cache, indices, n: int, name: str):
    """n caches [n, blocks, page, bytes] as one [n*blocks, page, bytes]; each element's valid
    indices shifted onto its own part, invalid ones set to -1 (they stay masked)."""
    blocks, page = int(cache.shape[1]), int(cache.shape[2])
    tokens = blocks * page
    if n * tokens > _INT32_MAX:
        raise NotImplementedError(
            f"vmap of sparse_mla_decode over {name}: the {n} mapped caches are stacked into one of "
            f"{n * tokens} token slots, more than int32 indices can address ({_INT32_MAX}); map fewer "
            "caches or pass one shared (unmapped) cache")
    offset = (jnp.arange(n, dtype=jnp.int32) * tokens).reshape(n, 1, 1, 1)
    valid = (indices >= 0) & (indices < tokens)
    indices = jnp.where(valid, indices + offset, -1)
    return cache.reshape(n * blocks, *cache.shape[2:]), indices


def _fold_batch(static: DecodeStatic, n: int, in_batched, ops):
    """vmap rule: every mapped dim folds into the request batch, one decode runs, and the
    results unfold. A mapped cache is supported by stacking the n caches into one (see
    `_stack_caches`); a mapped attn_sink becomes one sink row per folded request."""
    ops = DecodeOperands(*ops)
    batched = DecodeOperands(*in_batched)._replace(sched=False, num_splits=False)
    if not any(batched):
        # Only the plan is mapped: one unmapped decode serves every element.
        ops = ops._replace(sched=None, num_splits=None)
        if static.plan_parts is not None:
            plan = plan_for(static, ops)
            ops = ops._replace(sched=plan.sched, num_splits=plan.num_splits)
            static = dataclasses.replace(static, plan_unsplit=plan.unsplit)
        return batchable(static)(*ops.given()), (False, False)

    def per_element(x, is_batched):
        return x if is_batched else jnp.broadcast_to(x, (n, *x.shape))

    per_request = {name: per_element(getattr(ops, name), getattr(batched, name))
                   for name in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length")}
    b = int(per_request["q"].shape[1])

    # Request-major ([n, b] -> [b, n] -> [b*n]): a batch dim split over devices (data
    # parallel) stays a contiguous split of the folded batch, so no all-gather is needed.
    def fold(x):
        return jnp.swapaxes(x, 0, 1).reshape(b * n, *x.shape[2:])

    def unfold(x):
        return jnp.swapaxes(x.reshape(b, n, *x.shape[1:]), 0, 1)

    kv, ekv = ops.kv_cache, ops.extra_kv_cache
    if batched.kv_cache:
        kv, per_request["indices"] = _stack_caches(kv, per_request["indices"], n, "kv_cache")
    if batched.extra_kv_cache:
        if static.has_extra:
            ekv, per_request["extra_indices"] = _stack_caches(ekv, per_request["extra_indices"], n, "extra_kv_cache")
        else:  # the neutral placeholder; nothing reads it
            ekv = ekv[0]

    sink, inner = ops.attn_sink, static
    if static.sink_per_request:  # already [b, h_q]: folds like q
        sink = fold(per_element(sink, batched.attn_sink))
    elif batched.attn_sink:  # [n, h_q] -> one row per folded request
        inner = dataclasses.replace(static, sink_per_request=True)
        sink = jnp.tile(sink, (b, 1))  # folded row j * n + i is element i's
    folded = DecodeOperands(**{name: fold(x) for name, x in per_request.items()}, kv_cache=kv, extra_kv_cache=ekv,
                            attn_sink=sink)
    if static.plan_parts is not None:
        plan = plan_for(static, folded)
        folded = folded._replace(sched=plan.sched, num_splits=plan.num_splits)
        inner = dataclasses.replace(inner, plan_unsplit=plan.unsplit)
    out, lse = batchable(inner)(*folded.given())
    return (unfold(out), unfold(lse)), (True, True)

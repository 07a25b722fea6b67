"""The public op: plan_decode and sparse_mla_decode, as three XLA FFI calls.

One decode is: the split-KV planner (tiny, `plan.py`), the split-KV decode pass (writes
`out`/`lse` of requests done in one piece and fp32 partials of split ones, all
as ordinary XLA outputs) and the combine pass (updates `out`/`lse` in place; both in `_kernel.py`).
The same three targets exist for the CPU and CUDA platforms.

`sparse_mla_decode` validates its arguments here and runs the core through two wrappers:
  1. `custom_vmap` (_batching.py): mapped dims fold into the request batch.
  2. `custom_partitioning` with a Shardy sharding rule (_partitioning.py): under plain
     `jax.jit` with sharded inputs, each device decodes its own heads and/or requests.
Inside `shard_map` (all mesh axes manual) the partitioning wrapper lowers to its body, so the
op just runs on the local shapes there.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_sparse_mla import _ints
from jax_sparse_mla.formats import KVFormat, as_rank3
from jax_sparse_mla.op import _checks, _ffi
from jax_sparse_mla.op._batching import batchable
from jax_sparse_mla.op._operands import DecodeOperands, DecodeStatic
from jax_sparse_mla.op.plan import DecodePlan, lengths_or_full


def sparse_mla_decode(
    q,
    kv_cache,
    indices,
    *,
    sm_scale=None,
    topk_length=None,
    attn_sink=None,
    extra_kv_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    plan: DecodePlan | None = None,
    batch_invariant: bool = False,
):
    """Sparse MLA decode over an FP8 paged latent cache (docs/formats.md, docs/numerics.md).

    q `[b, s_q, h_q, d_qk]` bf16 (d_qk 576: V32, 512: MODEL1);
    kv_cache `[num_blocks, page_size, bytes]` (or `[.., 1, bytes]`) uint8/int8/fp8;
    indices `[b, s_q, topk]` int32 flat token ids `page * page_size + offset`
    (out-of-range ids are masked and never read; other integer dtypes are narrowed to int32
    with ids int32 cannot hold masked, host int64 values before JAX would wrap them);
    topk_length `[b]` int32 (or another integer dtype, clamped to `[0, topk]` first);
    attn_sink `[h_q]` float32;
    extra_kv_cache / extra_indices `[b, s_q, extra_topk]` / extra_topk_length `[b]`:
    a second cache (own page size) in the same softmax;
    plan: from `plan_decode` with the same shapes and lengths (computed here if None);
    batch_invariant: plan (or expect a plan made) with `plan_decode(batch_invariant=True)`:
    each request's results then depend on its own inputs alone (README "Reproducibility").

    Returns `out` `[b, s_q, h_q, 512]` bf16 and `lse` `[b, h_q, s_q]` float32.

    Transformations: under `jax.vmap` mapped dims fold into the request batch (a mapped
    cache is stacked into one, each element's indices shifted onto its part) and the plan is
    made for the folded batch. Under `jax.jit` with sharded inputs heads and/or requests are
    split across devices, caches replicated (see `jax_sparse_mla.sharding`); a passed plan is
    kept while only heads are split, and re-made per shard once requests are split.
    """
    operands, static = _prepare(q, kv_cache, indices, sm_scale, topk_length, attn_sink, extra_kv_cache,
                                extra_indices, extra_topk_length, plan, batch_invariant)
    return batchable(static)(*operands.given())


def _prepare(q, kv_cache, indices, sm_scale, topk_length, attn_sink, extra_kv_cache, extra_indices,
             extra_topk_length, plan, batch_invariant):
    """Validates every operand and fills the optional ones with neutral values: the operands of
    the core (caches rank 3, the plan's arrays if one is passed) and its static attributes."""
    _checks.check_dtype("q", q, (jnp.bfloat16,))
    b, s_q, h_q, d_qk = _checks.check_q_shape(q)
    if d_qk not in (576, 512):
        raise ValueError(f"q: expected last dim d_qk in {{576 (V32), 512 (MODEL1)}}, got d_qk={d_qk}")
    fmt = KVFormat.from_d_qk(d_qk)
    cache = _checks.check_cache("kv_cache", kv_cache, fmt)

    indices = _ints.ids_int32("indices", indices, cache.num_blocks * cache.page_size)
    _checks.check_dtype("indices", indices, (jnp.int32,))
    topk = _checks.check_ids_shape("indices", indices, b, s_q, "topk")

    scale = d_qk ** -0.5 if sm_scale is None else _checks.check_static_float("sm_scale", sm_scale)
    lengths = lengths_or_full("topk_length", topk_length, b, topk)

    has_sink = attn_sink is not None
    if has_sink:
        _checks.check_dtype("attn_sink", attn_sink, (jnp.float32,))
        _checks.check_shape("attn_sink", attn_sink, (h_q,), "[h_q]")
    else:
        attn_sink = jnp.zeros((h_q,), jnp.float32)

    if (extra_kv_cache is None) != (extra_indices is None):
        given, missing = ("extra_kv_cache", "extra_indices") if extra_indices is None else (
            "extra_indices", "extra_kv_cache")
        raise ValueError(f"{given}: given without {missing}; pass both or neither")
    if extra_indices is None:
        if extra_topk_length is not None:
            raise ValueError("extra_topk_length: given without extra_kv_cache / extra_indices")
        extra_kv_cache = jnp.zeros((1, 1, fmt.bytes_per_token), jnp.uint8)
        extra_indices = jnp.zeros((b, s_q, 0), jnp.int32)
        extra_page_size = 1
    else:
        extra = _checks.check_cache("extra_kv_cache", extra_kv_cache, fmt)
        extra_page_size = extra.page_size
        extra_indices = _ints.ids_int32("extra_indices", extra_indices, extra.num_blocks * extra.page_size)
        _checks.check_dtype("extra_indices", extra_indices, (jnp.int32,))
        _checks.check_ids_shape("extra_indices", extra_indices, b, s_q, "extra_topk")
    extra_topk = _checks._shape(extra_indices)[2]
    extra_lengths = lengths_or_full("extra_topk_length", extra_topk_length, b, extra_topk)

    _checks.check_static_bool("batch_invariant", batch_invariant)
    if plan is not None:  # None: the decode core plans for the shapes it runs on (per shard, per fold)
        _check_plan(plan, b, topk, extra_topk, batch_invariant)
    operands = DecodeOperands(
        q=q, kv_cache=as_rank3(kv_cache), indices=indices, topk_length=lengths, extra_kv_cache=as_rank3(extra_kv_cache),
        extra_indices=extra_indices, extra_topk_length=extra_lengths, attn_sink=attn_sink,
        sched=None if plan is None else plan.sched, num_splits=None if plan is None else plan.num_splits)
    static = DecodeStatic(
        sm_scale=float(scale), fmt=fmt, page_size=cache.page_size, extra_page_size=extra_page_size,
        has_sink=has_sink, has_extra=extra_topk > 0, sink_per_request=False,
        plan_parts=None if plan is None else plan.num_parts, batch_invariant=batch_invariant,
        full_lists=topk_length is None and extra_topk_length is None,
        plan_unsplit=plan is not None and plan.unsplit)
    return operands, static


def _check_plan(plan, b: int, topk: int, extra_topk: int, batch_invariant: bool) -> None:
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"plan: expected a DecodePlan from plan_decode, got {type(plan).__name__}")
    got = (plan.batch, plan.topk, plan.extra_topk)
    if got != (b, topk, extra_topk):
        raise ValueError(
            f"plan: made for (b, topk, extra_topk) = {got}, but this call has {(b, topk, extra_topk)}; "
            "plan with the same indices shapes and lengths")
    if _checks._shape(plan.num_splits) != (b + 1,):
        raise ValueError(f"plan.num_splits: expected shape ({b + 1},), got {_checks._shape(plan.num_splits)}")
    if plan.batch_invariant != batch_invariant:
        raise ValueError(
            f"plan: made with batch_invariant={plan.batch_invariant}, but this call has "
            f"batch_invariant={batch_invariant}; pass the same batch_invariant to plan_decode and sparse_mla_decode")


# --- jax.export -------------------------------------------------------------------------------

def export_disabled_checks() -> tuple:
    """The `disabled_checks` to pass to `jax.export.export` for a function using this op: one
    `DisabledSafetyCheck.custom_call` per FFI target (plan, decode, combine). The exported
    artifact needs `jax_sparse_mla` imported (targets registered) wherever it is called.
    Export the single-device (or shard_map) program: a jit-sharded one embeds a Python
    partitioning callback that cannot be serialized."""
    from jax import export

    return tuple(export.DisabledSafetyCheck.custom_call(name) for name in _ffi.TARGETS)


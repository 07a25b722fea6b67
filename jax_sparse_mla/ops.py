"""The public op: plan_decode and sparse_mla_decode, as three XLA FFI calls.

One decode is: the split-KV planner (tiny), the split-KV decode pass (writes
`out`/`lse` of requests done in one piece and fp32 partials of split ones, all
as ordinary XLA outputs) and the combine pass (updates `out`/`lse` in place).
The same three targets exist for the CPU and CUDA platforms.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import _checks, _ffi, _ints
from jax_sparse_mla.formats import D_V, KVFormat

HEADS_PER_CTA = 64
# More workers than this only adds empty partial-buffer rows ([b + num_parts, s_q, h_q, 512] f32).
MAX_NUM_PARTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static facts the schedule is sized from.

    `num_sms` bounds the worker count; on CUDA the handler lowers it to what the
    GPU running the call actually has, so no device is queried while tracing.
    132 is the H100/H200 SXM count; no Hopper part has more.
    """

    num_sms: int = 132


CPU_WORKERS = 8


@functools.cache
def default_config() -> DecodeConfig:
    """The config used when none is given, fixed once at first use from JAX's
    default backend. GPUs get 132 SMs (the CUDA handler fits it to the GPU). The
    CPU handler runs workers one after another, so a few keep the fp32 partial
    buffers `[b + workers, ...]` small while still exercising the combine pass."""
    return DecodeConfig(num_sms=132 if jax.default_backend() in ("gpu", "cuda") else CPU_WORKERS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A split-KV schedule. Depends only on shapes and the length arrays, so one
    plan serves every layer of a decode step. Its arrays are ordinary JAX
    values: compute it inside the jitted step (or pass it in)."""

    sched: jax.Array  # [num_parts, 8] int32, one row per worker (docs/schedule.md)
    num_splits: jax.Array  # [b + 1] int32, prefix sum of pieces per request
    batch: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(metadata=dict(static=True))
    extra_topk: int = dataclasses.field(metadata=dict(static=True))
    # Made by plan_decode(batch_invariant=True): one worker per fixed chunk of each request.
    batch_invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_parts(self) -> int:
        return int(self.sched.shape[0])


def default_num_parts(s_q: int, h_q: int, config: DecodeConfig | None = None) -> int:
    """FlashMLA's worker count: SMs / s_q / (head groups of 64), at least 1."""
    config = config or default_config()
    return max(config.num_sms // s_q // math.ceil(h_q / HEADS_PER_CTA), 1)


def plan_decode(
    q,
    indices,
    *,
    topk_length=None,
    extra_indices=None,
    extra_topk_length=None,
    num_parts: int | None = None,
    config: DecodeConfig | None = None,
    batch_invariant: bool = False,
) -> DecodePlan:
    """Plans the split-KV schedule of `sparse_mla_decode`.

    Only the shapes of `q` `[b, s_q, h_q, d_qk]`, `indices` `[b, s_q, topk]` and
    `extra_indices` `[b, s_q, extra_topk]` are used (arrays or
    `jax.ShapeDtypeStruct`s), plus the values of the optional `[b]` int32 length
    arrays. Pass the same lengths to `sparse_mla_decode`.

    `num_parts`: the number of workers. Default: `default_num_parts(s_q, h_q)`,
    fitted on CUDA to the SM count of the GPU that runs it. An explicit value is
    used as is (useful to force many small pieces).

    `batch_invariant`: every request is cut into fixed chunks of its own blocks, one
    worker each, so its `out`/`lse` do not depend on the other requests, the batch
    size, `num_parts` or the sharding (README "Reproducibility"). The worker count is
    then `b * max_chunks` (the chunks of a request of full `topk` + `extra_topk`); a
    larger `num_parts` only adds empty workers.
    """
    _checks.check_static_bool("batch_invariant", batch_invariant)
    q_shape, idx_shape = _checks._shape(q), _checks._shape(indices)
    if len(q_shape) != 4:
        raise ValueError(f"q: expected shape [b, s_q, h_q, d_qk], got {q_shape}")
    b, s_q, h_q, _ = q_shape
    if min(b, s_q, h_q) < 1:
        raise ValueError(f"q: b, s_q and h_q must be >= 1, got shape {q_shape}")
    if len(idx_shape) != 3 or idx_shape[:2] != (b, s_q) or idx_shape[2] < 1:
        raise ValueError(f"indices: expected shape [b, s_q, topk] = ({b}, {s_q}, topk >= 1), got {idx_shape}")
    topk = idx_shape[2]
    extra_topk = 0
    if extra_indices is not None:
        e_shape = _checks._shape(extra_indices)
        if len(e_shape) != 3 or e_shape[:2] != (b, s_q) or e_shape[2] < 1:
            raise ValueError(
                f"extra_indices: expected shape [b, s_q, extra_topk] = ({b}, {s_q}, extra_topk >= 1), got {e_shape}")
        extra_topk = e_shape[2]
    elif extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_indices")
    fit = num_parts is None and not batch_invariant
    if batch_invariant:
        num_parts = _invariant_num_parts(b, topk, extra_topk, num_parts)
    elif num_parts is None:
        num_parts = default_num_parts(s_q, h_q, config)
    if not isinstance(num_parts, (int, np.integer)) or not 1 <= num_parts <= MAX_NUM_PARTS:
        raise ValueError(f"num_parts: expected an int in [1, {MAX_NUM_PARTS}], got {num_parts!r}")
    lengths = _lengths_or_full("topk_length", topk_length, b, topk)
    extra_lengths = _lengths_or_full("extra_topk_length", extra_topk_length, b, extra_topk)
    sched, num_splits = jax.ffi.ffi_call(
        _ffi.PLAN_TARGET,
        (
            jax.ShapeDtypeStruct((int(num_parts), 8), jnp.int32),
            jax.ShapeDtypeStruct((b + 1,), jnp.int32),
        ),
        # Under vmap every mapped element gets its own plan (a loop over tiny calls);
        # sparse_mla_decode under vmap plans the folded batch itself.
        vmap_method="sequential",
    )(
        lengths,
        extra_lengths,
        topk=np.int64(topk),
        extra_topk=np.int64(extra_topk),
        num_parts=np.int64(num_parts),
        fit_to_device=bool(fit),
        parts_divisor=np.int64(s_q * math.ceil(h_q / HEADS_PER_CTA)),
        batch_invariant=batch_invariant,
    )
    return DecodePlan(sched=sched, num_splits=num_splits, batch=b, topk=topk, extra_topk=extra_topk,
                      batch_invariant=batch_invariant)


def _invariant_num_parts(b: int, topk: int, extra_topk: int, num_parts) -> int:
    """The worker count of a batch-invariant plan: one per chunk of every request, or the
    caller's `num_parts` if that is larger."""
    chunks = _ffi.max_chunks(topk, extra_topk)
    need = b * chunks
    if need > MAX_NUM_PARTS:
        raise ValueError(
            f"batch_invariant: b={b} requests of up to {chunks} chunks need {need} workers, more than "
            f"{MAX_NUM_PARTS}; decode fewer requests per call")
    if num_parts is None:
        return need
    if isinstance(num_parts, (int, np.integer)) and num_parts < need:
        raise ValueError(
            f"num_parts: a batch-invariant plan has one worker per chunk of {_ffi.CHUNK_BLOCKS} blocks, "
            f"b * {chunks} = {need} here; expected num_parts >= {need} (or None), got {num_parts}")
    return num_parts


def _lengths_or_full(name: str, lengths, batch: int, full: int):
    if lengths is None:
        return jnp.full((batch,), full, jnp.int32)
    lengths = _ints.lengths_int32(lengths, full)
    _checks.check_lengths(name, lengths, batch)
    return lengths


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
    args = _prepare(q, kv_cache, indices, sm_scale, topk_length, attn_sink, extra_kv_cache, extra_indices,
                    extra_topk_length, plan, batch_invariant)
    return _transformable_decode(args, user_plan=plan is not None)


def _prepare(q, kv_cache, indices, sm_scale, topk_length, attn_sink, extra_kv_cache, extra_indices,
             extra_topk_length, plan, batch_invariant):
    """Validates every operand and fills the optional ones with neutral values."""
    _checks.check_dtype("q", q, (jnp.bfloat16,))
    q_shape = _checks._shape(q)
    if len(q_shape) != 4:
        raise ValueError(f"q: expected shape [b, s_q, h_q, d_qk], got {q_shape}")
    b, s_q, h_q, d_qk = q_shape
    if min(b, s_q, h_q) < 1:
        raise ValueError(f"q: b, s_q and h_q must be >= 1, got shape {q_shape}")
    if d_qk not in (576, 512):
        raise ValueError(f"q: expected last dim d_qk in {{576 (V32), 512 (MODEL1)}}, got d_qk={d_qk}")
    fmt = KVFormat.from_d_qk(d_qk)
    cache = _checks.check_cache("kv_cache", kv_cache, fmt)

    indices = _ints.ids_int32("indices", indices, cache.num_blocks * cache.page_size)
    _checks.check_dtype("indices", indices, (jnp.int32,))
    idx_shape = _checks._shape(indices)
    if len(idx_shape) != 3 or idx_shape[:2] != (b, s_q) or idx_shape[2] < 1:
        raise ValueError(f"indices: expected shape [b, s_q, topk] = ({b}, {s_q}, topk >= 1), got {idx_shape}")
    topk = idx_shape[2]

    scale = d_qk ** -0.5 if sm_scale is None else _checks.check_static_float("sm_scale", sm_scale)
    lengths = _lengths_or_full("topk_length", topk_length, b, topk)

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
        e_shape = _checks._shape(extra_indices)
        if len(e_shape) != 3 or e_shape[:2] != (b, s_q) or e_shape[2] < 1:
            raise ValueError(
                f"extra_indices: expected shape [b, s_q, extra_topk] = ({b}, {s_q}, extra_topk >= 1), got {e_shape}")
    extra_topk = _checks._shape(extra_indices)[2]
    extra_lengths = _lengths_or_full("extra_topk_length", extra_topk_length, b, extra_topk)

    _checks.check_static_bool("batch_invariant", batch_invariant)
    if plan is not None:  # None: the decode core plans for the shapes it runs on (per shard, per fold)
        _check_plan(plan, b, topk, extra_topk, batch_invariant)
    return dict(q=q, kv_cache=kv_cache, indices=indices, topk_length=lengths, extra_kv_cache=extra_kv_cache,
                extra_indices=extra_indices, extra_topk_length=extra_lengths, attn_sink=attn_sink, plan=plan,
                sm_scale=float(scale), fmt=fmt, page_size=cache.page_size, extra_page_size=extra_page_size,
                has_sink=has_sink, batch_invariant=batch_invariant)


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


def _decode(*, q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length, attn_sink, plan,
            sm_scale, fmt, page_size, extra_page_size, has_sink):
    """The two FFI calls on validated operands."""
    b, s_q, h_q, _ = q.shape
    parts = plan.num_parts
    out, lse, out_accum, lse_accum = jax.ffi.ffi_call(
        _ffi.DECODE_TARGET,
        (
            jax.ShapeDtypeStruct((b, s_q, h_q, D_V), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, h_q, s_q), jnp.float32),
            jax.ShapeDtypeStruct((b + parts, s_q, h_q, D_V), jnp.float32),
            jax.ShapeDtypeStruct((b + parts, s_q, h_q), jnp.float32),
        ),
    )(
        q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length, attn_sink,
        plan.sched, plan.num_splits,
        sm_scale=np.float32(sm_scale),
        kv_format=np.int32(fmt.code),
        page_size=np.int64(page_size),
        extra_page_size=np.int64(extra_page_size),
        has_sink=bool(has_sink),
    )
    out, lse = jax.ffi.ffi_call(
        _ffi.COMBINE_TARGET,
        (jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype)),
        input_output_aliases={0: 0, 1: 1},
    )(out, lse, out_accum, lse_accum, plan.num_splits, attn_sink, has_sink=bool(has_sink))
    return out, lse


# ---------------------------------------------------------------------------------------------
# Transformations.
#
# `sparse_mla_decode` runs through two wrappers around the FFI calls above:
#   1. `custom_vmap` (_batching.py): mapped dims fold into the request batch.
#   2. `custom_partitioning` with a Shardy sharding rule (_partitioning.py): under plain
#      `jax.jit` with sharded inputs, each device decodes its own heads and/or requests.
# Inside `shard_map` (all mesh axes manual) the partitioning wrapper lowers to its body, so the
# op just runs on the local shapes there.

# Operand order of the wrapped core (the plan arrays only when the caller passed a plan).
_CORE_OPERANDS = ("q", "kv_cache", "indices", "topk_length", "extra_kv_cache", "extra_indices",
                  "extra_topk_length", "attn_sink")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one decode call (hashable: it keys the wrapper caches)."""

    sm_scale: float
    fmt: KVFormat
    page_size: int
    extra_page_size: int
    has_sink: bool
    has_extra: bool
    # attn_sink is [b, h_q] (one row per request) instead of [h_q]: vmap of a mapped sink.
    sink_per_request: bool
    # The worker count of a plan the caller passed (its arrays are then core operands);
    # None: the core plans for the shapes it sees (per shard, per folded batch).
    plan_parts: int | None
    # Plans (passed or re-made per shard / folded batch) are batch-invariant ones.
    batch_invariant: bool


def _rank3(cache):
    """A FlashMLA-shaped [num_blocks, page_size, 1, bytes] cache as [num_blocks, page_size, bytes]
    (same bytes; a bitcast in XLA)."""
    shape = _checks._shape(cache)
    return cache.reshape(shape[0], shape[1], shape[3]) if len(shape) == 4 else cache


def _transformable_decode(args: dict, *, user_plan: bool):
    """`sparse_mla_decode` after validation: the batching and partitioning wrappers."""
    plan = args["plan"]
    static = _Static(
        sm_scale=float(args["sm_scale"]), fmt=args["fmt"], page_size=int(args["page_size"]),
        extra_page_size=int(args["extra_page_size"]), has_sink=bool(args["has_sink"]),
        has_extra=_checks._shape(args["extra_indices"])[2] > 0, sink_per_request=False,
        plan_parts=plan.num_parts if user_plan else None, batch_invariant=args["batch_invariant"])
    ops = [args[name] for name in _CORE_OPERANDS]
    ops[1], ops[4] = _rank3(ops[1]), _rank3(ops[4])
    if user_plan:
        ops += [plan.sched, plan.num_splits]
    from jax_sparse_mla._batching import batchable  # imports this module

    return batchable(static)(*ops)


def _plan_for(static: _Static, q, indices, topk_length, extra_indices, extra_topk_length) -> DecodePlan:
    # A batch-invariant plan's worker count follows the batch it is re-made for.
    return plan_decode(q, indices, topk_length=topk_length,
                       extra_indices=extra_indices if static.has_extra else None,
                       extra_topk_length=extra_topk_length if static.has_extra else None,
                       num_parts=None if static.batch_invariant else static.plan_parts,
                       batch_invariant=static.batch_invariant)


def _local_decode(static: _Static, ops, *, replan: bool):
    """The FFI pipeline on the shapes at hand; `replan` ignores a passed plan."""
    q, kv, idx, tl, ekv, eidx, etl, sink = ops[:8]
    if len(ops) == 10 and not replan:
        plan = DecodePlan(sched=ops[8], num_splits=ops[9], batch=int(q.shape[0]), topk=int(idx.shape[2]),
                          extra_topk=int(eidx.shape[2]), batch_invariant=static.batch_invariant)
    else:
        plan = _plan_for(static, q, idx, tl, eidx, etl)
    return _decode(q=q, kv_cache=kv, indices=idx, topk_length=tl, extra_kv_cache=ekv, extra_indices=eidx,
                   extra_topk_length=etl, attn_sink=sink, plan=plan, sm_scale=static.sm_scale, fmt=static.fmt,
                   page_size=static.page_size, extra_page_size=static.extra_page_size, has_sink=static.has_sink)


# --- jax.export -------------------------------------------------------------------------------

def export_disabled_checks() -> tuple:
    """The `disabled_checks` to pass to `jax.export.export` for a function using this op: one
    `DisabledSafetyCheck.custom_call` per FFI target (plan, decode, combine). The exported
    artifact needs `jax_sparse_mla` imported (targets registered) wherever it is called.
    Export the single-device (or shard_map) program: a jit-sharded one embeds a Python
    partitioning callback that cannot be serialized."""
    from jax import export

    return tuple(export.DisabledSafetyCheck.custom_call(name) for name in _ffi.TARGETS)

"""The decode core: the decode and combine FFI calls on validated operands, with the plan
passed in or made for the shapes at hand. What the vmap and sharding wrappers run."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla.op import _ffi
from jax_sparse_mla.op._operands import DecodeOperands, DecodeStatic
from jax_sparse_mla.op.plan import DecodePlan, plan_decode
from jax_sparse_mla.formats import D_V


def plan_for(static: DecodeStatic, ops: DecodeOperands) -> DecodePlan:
    """A plan for the operands at hand (their batch, per shard or folded), with the worker count
    of a passed plan; a batch-invariant plan's worker count follows the batch it is made for."""
    full = static.full_lists  # (the operands' lengths are then full: the plan may say unsplit)
    return plan_decode(ops.q, ops.indices, topk_length=None if full else ops.topk_length,
                       extra_indices=ops.extra_indices if static.has_extra else None,
                       extra_topk_length=None if full or not static.has_extra else ops.extra_topk_length,
                       num_parts=None if static.batch_invariant else static.plan_parts,
                       batch_invariant=static.batch_invariant)


def local_decode(static: DecodeStatic, ops: DecodeOperands, *, replan: bool):
    """The decode and combine FFI calls on the shapes at hand (no combine where the plan is known
    to cut no request); `replan` ignores a passed plan."""
    b, s_q, h_q, _ = ops.q.shape
    if ops.sched is not None and not replan:
        plan = DecodePlan(sched=ops.sched, num_splits=ops.num_splits, batch=int(b), topk=int(ops.indices.shape[2]),
                          extra_topk=int(ops.extra_indices.shape[2]), batch_invariant=static.batch_invariant,
                          unsplit=static.plan_unsplit)
    else:
        plan = plan_for(static, ops)
    ops = ops._replace(sched=plan.sched, num_splits=plan.num_splits)
    parts = plan.num_parts
    out, lse, out_accum, lse_accum = jax.ffi.ffi_call(
        _ffi.DECODE_TARGET,
        (
            jax.ShapeDtypeStruct((b, s_q, h_q, D_V), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, h_q, s_q), jnp.float32),
            jax.ShapeDtypeStruct((b + parts, s_q, h_q, D_V), jnp.float32),
            jax.ShapeDtypeStruct((b + parts, s_q, h_q), jnp.float32),
        ),
    )(*ops, **static.ffi_attributes())
    if plan.unsplit:  # every request in one piece: the decode wrote every out/lse row
        return out, lse
    out, lse = jax.ffi.ffi_call(
        _ffi.COMBINE_TARGET,
        (jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype)),
        input_output_aliases={0: 0, 1: 1},
    )(out, lse, out_accum, lse_accum, ops.num_splits, ops.attn_sink, has_sink=bool(static.has_sink))
    return out, lse

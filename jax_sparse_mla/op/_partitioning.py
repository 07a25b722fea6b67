"""Sharding of `sparse_mla_decode` under plain `jax.jit`: a `custom_partitioning` rule.

Requests (b) and heads (h) may be split; every other factor stays replicated, so each device
decodes its own requests and/or heads from the replicated caches and no collective is added.
Inside `shard_map` (all mesh axes manual) the wrapper lowers to its body on local shapes.
"""

from __future__ import annotations

import functools
import math

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from jax_sparse_mla.op._kernel import local_decode
from jax_sparse_mla.op._operands import (HEADS, REQUESTS, RESULT_FACTORS, RESULTS, DecodeOperands, DecodeStatic,
                                      partition_spec)


def _rule(static: DecodeStatic) -> str:
    """The Shardy rule of this call, from the operands' and results' factors."""
    operands = ", ".join(f for f in static.factors() if f is not None)
    return operands + " -> " + ", ".join(RESULT_FACTORS[name] for name in RESULTS)


def _replicated_factors(rule: str) -> tuple:
    """Every factor but the request and head ones, in order of first appearance (Shardy wants
    them sorted)."""
    seen = []
    for ch in rule:
        if ch.isalpha() and ch not in seen:
            seen.append(ch)
    return tuple(f for f in seen if f not in (REQUESTS, HEADS))


@functools.lru_cache(maxsize=None)
def partitionable(static: DecodeStatic):
    def decode(*ops):
        return local_decode(static, DecodeOperands(*ops), replan=False)

    wrapped = custom_partitioning(decode)
    rule = _rule(static)
    wrapped.def_partition(
        partition=functools.partial(_partition, static),
        infer_sharding_from_operands=functools.partial(_infer_shardings, static),
        sharding_rule=rule,
        need_replication_factors=_replicated_factors(rule),
    )
    return wrapped


def _spec_axes(sharding, dim: int) -> tuple:
    """The mesh axes dim `dim` of a NamedSharding is split over (empty if none or unknown)."""
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return ()
    entry = spec[dim]
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _split_axes(mesh, size: int, *candidates) -> tuple:
    """The first candidate axes that divide `size` evenly (an uneven split is not done)."""
    for axes in candidates:
        if axes and all(a in mesh.shape for a in axes):
            ways = math.prod(mesh.shape[a] for a in axes)
            if ways > 1 and size % ways == 0:
                return axes
    return ()


def _choose_split(static: DecodeStatic, mesh, arg_shapes, result_shapes):
    args, out = DecodeOperands(*arg_shapes), result_shapes[0]
    b, _, h, _ = args.q.shape
    factors = static.factors()

    def axes_of(operand: str, factor: str) -> tuple:
        return _spec_axes(getattr(args, operand).sharding, getattr(factors, operand).split().index(factor))

    b_axes = _split_axes(mesh, b, axes_of("q", REQUESTS), _spec_axes(out.sharding, 0), axes_of("indices", REQUESTS))
    h_axes = _split_axes(mesh, h, axes_of("q", HEADS), _spec_axes(out.sharding, 2), axes_of("attn_sink", HEADS))
    if set(h_axes) & set(b_axes):
        h_axes = ()
    return b_axes, h_axes


def _shardings(static: DecodeStatic, mesh, b_axes, h_axes):
    """Operand and result shardings: request factors over `b_axes`, head factors over `h_axes`,
    every other factor replicated."""
    axes = {REQUESTS: b_axes, HEADS: h_axes}

    def ns(factors: str):
        return NamedSharding(mesh, partition_spec(factors, axes))

    args = tuple(ns(f) for f in static.factors() if f is not None)
    return args, tuple(ns(RESULT_FACTORS[name]) for name in RESULTS)


def _partition(static: DecodeStatic, mesh, arg_shapes, result_shape):
    b_axes, h_axes = _choose_split(static, mesh, arg_shapes, result_shape)
    arg_shardings, result_shardings = _shardings(static, mesh, b_axes, h_axes)

    # A plan covers the requests it was made for: with the batch split each shard plans its
    # own requests. A head split keeps a passed plan (any plan for these requests is valid).
    def lower(*ops):
        return local_decode(static, DecodeOperands(*ops), replan=bool(b_axes))

    return mesh, lower, result_shardings, arg_shardings


def _infer_shardings(static: DecodeStatic, mesh, arg_shapes, result_shape):
    """Result shardings for the GSPMD partitioner (`jax_use_shardy_partitioner` off)."""
    b_axes, h_axes = _choose_split(static, mesh, arg_shapes, result_shape)
    return _shardings(static, mesh, b_axes, h_axes)[1]

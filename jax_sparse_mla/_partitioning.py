"""Sharding of `sparse_mla_decode` under plain `jax.jit`: a `custom_partitioning` rule.

Requests (b) and heads (h) may be split; every other factor stays replicated, so each device
decodes its own requests and/or heads from the replicated caches and no collective is added.
Inside `shard_map` (all mesh axes manual) the wrapper lowers to its body on local shapes.
"""

from __future__ import annotations

import functools
import math

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_sparse_mla.ops import _local_decode, _Static

# Shardy rule: b (requests) and h (heads) may be split; every other factor stays replicated.
_RULE_OPERANDS = "b s h d, n p c, b s k, b, m r e, b s j, b, "  # + the sink's factors
_RULE_PLAN = ", w f, t"
_RULE_RESULTS = "b s h v, b h s"
_SPLIT_FACTORS = ("b", "h")


def _replicated_factors(rule: str) -> tuple:
    """Every factor but b and h, in order of first appearance (Shardy wants them sorted)."""
    seen = []
    for ch in rule:
        if ch.isalpha() and ch not in seen:
            seen.append(ch)
    return tuple(f for f in seen if f not in _SPLIT_FACTORS)


@functools.lru_cache(maxsize=None)
def partitionable(static: _Static):
    def decode(*ops):
        return _local_decode(static, ops, replan=False)

    wrapped = custom_partitioning(decode)
    with_plan = static.plan_parts is not None
    sink = "b h" if static.sink_per_request else "h"
    rule = _RULE_OPERANDS + sink + (_RULE_PLAN if with_plan else "") + " -> " + _RULE_RESULTS
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


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _choose_split(static: _Static, mesh, arg_shapes, result_shapes):
    q, out, sink = arg_shapes[0], result_shapes[0], arg_shapes[7]
    b, _, h, _ = q.shape
    sink_h = 1 if static.sink_per_request else 0
    b_axes = _split_axes(mesh, b, _spec_axes(q.sharding, 0), _spec_axes(out.sharding, 0),
                         _spec_axes(arg_shapes[2].sharding, 0))
    h_axes = _split_axes(mesh, h, _spec_axes(q.sharding, 2), _spec_axes(out.sharding, 2),
                         _spec_axes(sink.sharding, sink_h))
    if set(h_axes) & set(b_axes):
        h_axes = ()
    return b_axes, h_axes


def _shardings(static: _Static, mesh, b_axes, h_axes):
    bb, hh = _entry(b_axes), _entry(h_axes)

    def ns(*spec):
        return NamedSharding(mesh, PartitionSpec(*spec))

    sink = ns(bb, hh) if static.sink_per_request else ns(hh)
    args = [ns(bb, None, hh, None), ns(), ns(bb, None, None), ns(bb), ns(), ns(bb, None, None), ns(bb), sink]
    if static.plan_parts is not None:
        args += [ns(), ns()]
    results = (ns(bb, None, hh, None), ns(bb, hh, None))
    return tuple(args), results


def _partition(static: _Static, mesh, arg_shapes, result_shape):
    b_axes, h_axes = _choose_split(static, mesh, arg_shapes, result_shape)
    arg_shardings, result_shardings = _shardings(static, mesh, b_axes, h_axes)

    # A plan covers the requests it was made for: with the batch split each shard plans its
    # own requests. A head split keeps a passed plan (any plan for these requests is valid).
    def lower(*ops):
        return _local_decode(static, ops, replan=bool(b_axes))

    return mesh, lower, result_shardings, arg_shardings


def _infer_shardings(static: _Static, mesh, arg_shapes, result_shape):
    """Result shardings for the GSPMD partitioner (`jax_use_shardy_partitioner` off)."""
    b_axes, h_axes = _choose_split(static, mesh, arg_shapes, result_shape)
    return _shardings(static, mesh, b_axes, h_axes)[1]

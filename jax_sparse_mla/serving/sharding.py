"""Running `sparse_mla_decode` on several devices.

Two ways, both splitting heads (tensor parallel) and/or requests (data parallel):

* Plain `jax.jit` with `NamedSharding` inputs. The op carries its own partitioning rule (a
  Shardy sharding rule, `op/_partitioning.py`, from the operands' factors in `op/_operands.py`): `q`/`out`/`lse`/`attn_sink` may be split over heads and
  `q`/`indices`/lengths/`out`/`lse` over requests; the caches stay replicated, and no
  collective is added. `decode_shardings` / `shard_decode_inputs` place the arguments.
* `shard_map`, where every device runs the op on its local shapes. `shard_map_decode` builds
  such a function; `data_parallel_decode` is the data-parallel layout where each device also
  owns its own cache pool (the cache is split over its blocks, and the indices of a device's
  requests address its own pool).

Two layouts still gather the whole cache (correct, but slow): a cache the caller splits over its
blocks under plain jit (use `data_parallel_decode`, where each device's requests address its own
pool), and vmap over a group axis whose per-group caches are mapped and split over devices (the
fold stacks the caches, which the rule keeps replicated).

Plans: a `DecodePlan` describes the requests it was made for. Under plain jit a passed plan is
kept while only heads are split; once requests are split each shard plans its own requests
(the passed plan's worker count is kept). The shard_map helpers always plan per device.
With `batch_invariant=True` (the keyword of `sparse_mla_decode` and of the functions the shard_map
helpers return) a request gets the same bits in every layout as on one device (README
"Reproducibility"; on GPUs a head split is not yet verified).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_sparse_mla import _ints
from jax_sparse_mla.op._operands import (CACHE_BLOCKS, FACTORS, HEADS, REQUESTS, RESULT_FACTORS, USER_OPERANDS,
                                      partition_spec)
from jax_sparse_mla.op.decode import sparse_mla_decode

__all__ = [
    "data_parallel_decode",
    "decode_shardings",
    "output_shardings",
    "shard_decode_inputs",
    "shard_map_decode",
]

Axes = str | Sequence[str] | None


def _axes(mesh: Mesh, axes: Axes, what: str) -> tuple:
    if axes is None:
        return ()
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for name in names:
        if name not in mesh.shape:
            raise ValueError(f"{what}: {name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    return names


def _specs(mesh: Mesh, batch_axis: Axes, head_axis: Axes, cache_axis: Axes = None) -> dict:
    b = _axes(mesh, batch_axis, "batch_axis")
    h = _axes(mesh, head_axis, "head_axis")
    c = _axes(mesh, cache_axis, "cache_axis")
    if set(b) & set(h):
        raise ValueError(f"batch_axis {b} and head_axis {h} share a mesh axis")
    if c and not set(c) <= set(b):
        raise ValueError(
            f"cache_axis {c}: a cache split over blocks needs its requests split the same way "
            f"(batch_axis {b}); each device's requests address its own pool")
    axes = {REQUESTS: b, HEADS: h, **{f: c for f in CACHE_BLOCKS}}
    factors = {**{name: getattr(FACTORS, name) for name in USER_OPERANDS}, **RESULT_FACTORS}
    return {name: partition_spec(f, axes) for name, f in factors.items()}


def decode_shardings(mesh: Mesh, *, batch_axis: Axes = None, head_axis: Axes = None) -> dict:
    """`NamedSharding`s for every `sparse_mla_decode` argument (keyed by argument name) for
    running it under plain `jax.jit`: requests split over `batch_axis`, heads over `head_axis`
    (either may be None), both caches replicated."""
    specs = _specs(mesh, batch_axis, head_axis)
    return {name: NamedSharding(mesh, specs[name]) for name in USER_OPERANDS}


def output_shardings(mesh: Mesh, *, batch_axis: Axes = None, head_axis: Axes = None):
    """The (out, lse) shardings the op produces for `decode_shardings` inputs."""
    specs = _specs(mesh, batch_axis, head_axis)
    return NamedSharding(mesh, specs["out"]), NamedSharding(mesh, specs["lse"])


def _int32_operands(kwargs: dict) -> dict:
    """Indices and lengths as int32 with their meaning kept (`_ints`): `device_put` and
    `shard_map` would narrow host int64 values by dropping their high bits."""
    out = dict(kwargs)
    for ids, lengths in (("indices", "topk_length"), ("extra_indices", "extra_topk_length")):
        if out.get(ids) is not None:
            out[ids] = _ints.ids_int32(ids, out[ids])
            if out.get(lengths) is not None and np.ndim(out[ids]) > 0:  # else the op reports the shape
                out[lengths] = _ints.lengths_int32(out[lengths], np.shape(out[ids])[-1])
    return out


def shard_decode_inputs(mesh: Mesh, kwargs: dict, *, batch_axis: Axes = None, head_axis: Axes = None) -> dict:
    """`kwargs` (keyword arguments of `sparse_mla_decode`) with every array placed per
    `decode_shardings`; other entries (sm_scale, None, a plan) are passed through."""
    shardings = decode_shardings(mesh, batch_axis=batch_axis, head_axis=head_axis)
    return {k: jax.device_put(v, shardings[k]) if k in shardings and v is not None else v
            for k, v in _int32_operands(kwargs).items()}


def shard_map_decode(mesh: Mesh, *, batch_axis: Axes = None, head_axis: Axes = None,
                     cache_axis: Axes = None) -> Callable:
    """`sparse_mla_decode` under `jax.shard_map` on `mesh`: each device runs the op on its block
    of requests (`batch_axis`) and heads (`head_axis`).

    The caches are replicated unless `cache_axis` is given: then `kv_cache` (and
    `extra_kv_cache`) are split over their first dim (blocks), each device owning a pool of
    `num_blocks / devices` pages, and `cache_axis` must be among the batch axes: the indices of
    a device's requests are local ids into its own pool. Each device plans its own requests;
    no plan argument is taken. Returns `decode(q, kv_cache, indices, **kwargs) -> (out, lse)`
    with the same keyword arguments as `sparse_mla_decode` (minus `plan`); call it inside or
    outside `jax.jit`.
    """
    specs = _specs(mesh, batch_axis, head_axis, cache_axis)

    def decode(q, kv_cache, indices, *, sm_scale=None, topk_length=None, attn_sink=None, extra_kv_cache=None,
               extra_indices=None, extra_topk_length=None, batch_invariant=False):
        given = _int32_operands(dict(q=q, kv_cache=kv_cache, indices=indices, topk_length=topk_length,
                                     attn_sink=attn_sink, extra_kv_cache=extra_kv_cache,
                                     extra_indices=extra_indices, extra_topk_length=extra_topk_length))
        names = [n for n in USER_OPERANDS if given[n] is not None]

        def local(*arrays):
            return sparse_mla_decode(**dict(zip(names, arrays)), sm_scale=sm_scale, batch_invariant=batch_invariant)

        mapped = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[n] for n in names),
                               out_specs=(specs["out"], specs["lse"]))
        return mapped(*(given[n] for n in names))

    return decode


def data_parallel_decode(mesh: Mesh, axis: Axes = "dp", *, head_axis: Axes = None) -> Callable:
    """Data parallel over requests with a cache pool per device.

    Device `d` (along `axis`) holds requests `[d*b/D, (d+1)*b/D)` and the cache blocks
    `[d*nb/D, (d+1)*nb/D)`; its requests' indices are ids into that local pool
    (`local_page * page_size + offset`). Build the global cache by concatenating the per-device
    pools along blocks (or with `jax.make_array_from_single_device_arrays`). Heads may also be
    split over `head_axis` (the pool is then replicated over that axis).
    """
    return shard_map_decode(mesh, batch_axis=axis, head_axis=head_axis, cache_axis=axis)

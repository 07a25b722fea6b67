"""Trace-time validation of the decode operands.

Every failure names the argument and shows what was expected and what came.
Only shapes, dtypes and static values are inspected, so this runs under jit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_sparse_mla.formats import CACHE_DTYPES, KVFormat, cache_layout_problem


def _shape(x) -> tuple:
    return tuple(int(d) for d in np.shape(x))


def check_dtype(name: str, x, allowed) -> None:
    dt = jnp.dtype(x.dtype) if hasattr(x, "dtype") else None
    names = ", ".join(str(jnp.dtype(a)) for a in allowed)
    if dt is None or all(dt != jnp.dtype(a) for a in allowed):
        got = str(dt) if dt is not None else type(x).__name__
        raise TypeError(f"{name}: expected dtype {names}, got {got}")


def check_shape(name: str, x, expected: tuple, meaning: str) -> None:
    got = _shape(x)
    if got != tuple(expected):
        raise ValueError(f"{name}: expected shape {meaning} = {tuple(expected)}, got {got}")


def check_q_shape(q) -> tuple:
    """q's shape `(b, s_q, h_q, d_qk)`, with b, s_q and h_q at least 1."""
    shape = _shape(q)
    if len(shape) != 4:
        raise ValueError(f"q: expected shape [b, s_q, h_q, d_qk], got {shape}")
    if min(shape[:3]) < 1:
        raise ValueError(f"q: b, s_q and h_q must be >= 1, got shape {shape}")
    return shape


def check_ids_shape(name: str, ids, b: int, s_q: int, width: str) -> int:
    """The width (`topk` or `extra_topk`) of an `[b, s_q, width]` index list, at least 1."""
    shape = _shape(ids)
    if len(shape) != 3 or shape[:2] != (b, s_q) or shape[2] < 1:
        raise ValueError(f"{name}: expected shape [b, s_q, {width}] = ({b}, {s_q}, {width} >= 1), got {shape}")
    return shape[2]


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    fmt: KVFormat
    num_blocks: int
    page_size: int


def check_cache(name: str, cache, fmt: KVFormat) -> CacheInfo:
    check_dtype(name, cache, CACHE_DTYPES)
    shape = _shape(cache)
    problem = cache_layout_problem(shape, fmt)
    if problem == "rank4":
        raise ValueError(f"{name}: a rank-4 cache must be [num_blocks, page_size, 1, bytes], got {shape}")
    if problem == "rank":
        raise ValueError(
            f"{name}: expected shape [num_blocks, page_size, bytes_per_token] (or with a 1 before the last dim), "
            f"got {shape}"
        )
    if problem == "bytes":
        raise ValueError(
            f"{name}: last dim must be {fmt.name}'s bytes_per_token {fmt.bytes_per_token} "
            f"(format chosen by q's d_qk = {fmt.d_qk}), got {shape[-1]}"
        )
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name}: num_blocks and page_size must be >= 1, got {shape}")
    return CacheInfo(fmt, shape[0], shape[1])


def check_static_float(name: str, value: Any) -> float:
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"{name}: expected a static Python float, got {type(value).__name__}")
    try:
        out = float(value)
    except Exception as e:  # a tracer, an array with more than one element, ...
        raise TypeError(f"{name}: expected a static Python float, got {type(value).__name__}") from e
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{name}: expected a finite value > 0, got {out}")
    return out


def check_lengths(name: str, lengths, batch: int) -> None:
    check_dtype(name, lengths, (jnp.int32,))
    check_shape(name, lengths, (batch,), "[b]")


def check_static_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a Python bool (True or False), got {type(value).__name__}")
    return value

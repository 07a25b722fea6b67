"""Integer operands (token ids, list lengths) as JAX arrays, without wrap-around.

With JAX's default (x64 off) `jnp.asarray` narrows a NumPy int64 array to int32 by dropping the
high bits: slot 2**32 + 1 becomes slot 1, a real token. So host values (Python ints, lists, NumPy
arrays) are read at full width before they become JAX arrays, and JAX arrays wider than int32
(x64 on) are narrowed the same way: an id outside the cache becomes -1 (masked, or dropped by
`write_kv`), a length is clamped to `[0, topk]` first. Inside `jax.jit` JAX narrows a NumPy
argument before any of this runs: pass int32 there, or enable x64 (README, "Integer inputs").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)
INT32_MIN = int(np.iinfo(np.int32).min)
# Beyond every cache and every list: what out-of-range Python ints are clamped to.
_FAR = 2**62


def _host(x):
    """A host value as a NumPy array at full width; None for JAX arrays and tracers."""
    if isinstance(x, jax.Array):
        return None
    arr = np.asarray(x)
    if arr.dtype == object and all(isinstance(v, int) and not isinstance(v, bool) for v in arr.flat):
        # Python ints past 64 bits: clamping keeps every comparison with a cache or list size.
        arr = np.array([min(max(v, -1), _FAR) for v in arr.flat], np.int64).reshape(arr.shape)
    return arr


def _is_int(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer)


def _fits_int32(x) -> bool:
    info = jnp.iinfo(x.dtype)
    return INT32_MIN <= int(info.min) and int(info.max) <= INT32_MAX


def ids(name: str, x, num_tokens: int | None, *, int32_only: bool = False):
    """Token ids (indices, slots) into a cache of `num_tokens` tokens as a JAX array with the same
    meaning: a host id outside `[0, num_tokens)`, at any width, becomes -1 (`num_tokens` None:
    a cache int32 ids address, so only ids int32 cannot hold). JAX arrays (any integer dtype)
    pass through; non-integer input is returned for the caller's dtype check. A host id inside
    the cache that int32 cannot hold is an error unless x64 is on and the caller takes 64-bit
    ids (`int32_only` False)."""
    arr = _host(x)
    if arr is None:
        return x
    if not _is_int(arr):
        return arr
    if num_tokens is None:
        valid = (arr >= INT32_MIN) & (arr <= INT32_MAX)  # NumPy compares at full width
    else:
        valid = (arr >= 0) & (arr < num_tokens)
    out = np.full(arr.shape, -1, np.int64)
    out[valid] = arr[valid]
    top = int(out.max(initial=-1))
    if top <= INT32_MAX:
        return jnp.asarray(out.astype(np.int32))
    if int32_only:
        raise ValueError(f"{name}: id {top} lies in the cache ({num_tokens} tokens) but the kernels take int32 ids")
    if not jax.config.jax_enable_x64:
        raise ValueError(f"{name}: id {top} lies in the cache ({num_tokens} tokens) but needs 64 bits; "
                         "enable jax_enable_x64")
    return jnp.asarray(out)


def ids_int32(name: str, x, num_tokens: int | None = None):
    """`ids` narrowed to int32 for the kernels: ids that int32 cannot hold become -1."""
    x = ids(name, x, num_tokens, int32_only=True)
    if not _is_int(x) or jnp.dtype(x.dtype) == jnp.int32:
        return x
    if _fits_int32(x):
        return x.astype(jnp.int32)
    ok = x <= INT32_MAX
    if int(jnp.iinfo(x.dtype).min) < 0:
        ok = ok & (x >= INT32_MIN)
    return jnp.where(ok, x, -1).astype(jnp.int32)


def lengths_int32(x, topk: int):
    """List lengths as int32 with the same meaning: clamped to `[0, topk]` at full width first.
    int32 JAX arrays and non-integer input pass through (the kernels clamp int32 themselves)."""
    arr = _host(x)
    if arr is not None:
        return jnp.asarray(np.clip(arr, 0, topk).astype(np.int32)) if _is_int(arr) else arr
    if not _is_int(x) or jnp.dtype(x.dtype) == jnp.int32:
        return x
    return (x if _fits_int32(x) else jnp.clip(x, 0, topk)).astype(jnp.int32)

"""DeepSeek V3.2's lightning-indexer numerics, in pure (jit-able) JAX.

The indexer's queries and keys (RoPE already applied) are rotated by the normalized
Walsh-Hadamard transform (:func:`hadamard`), which spreads outliers over all dims, then
quantized to float8_e4m3fn with one float32 scale per vector (:func:`quantize_fp8`). Keys live
in a paged FP8 index cache: ``index_k [num_blocks, page_size, d]`` float8_e4m3fn codes and
``index_k_scale [num_blocks, page_size]`` float32 scales, on the same pages and token slots as
the latent cache (:func:`write_index_k`). The score of context token ``t`` for a query is
(:func:`index_scores`)::

    k_scale[t] * sum_h relu(q_codes[h] . k_codes[t]) * q_weight[h]

where the caller folds the query scale, the per-head weight and the softmax scales into
``q_weight``.

Scales: ``amax = max(max |x|, 1e-4)``; with `scale_fmt` "ue8m0" (DeepSeek V3.2's config) the
scale is the power of two ``2 ** ceil(log2(amax * (1/448)))``, with None it is
``amax * (1/448)`` itself. Codes are ``x / scale`` clipped to +-448 and rounded to nearest even.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_sparse_mla.formats import FP8_MAX, _pow2_from_exponent

__all__ = ["SCALE_FMTS", "hadamard", "index_scores", "quantize_fp8", "write_index_k"]

#: Accepted `scale_fmt` values: power-of-two scales ("ue8m0") or plain float32 scales (None).
SCALE_FMTS = ("ue8m0", None)
#: Smallest amax a scale is computed from (keeps an all-zero vector's scale finite).
_AMAX_FLOOR = 1e-4


def _check_scale_fmt(scale_fmt, fn: str) -> None:
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"{fn}: scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")


def hadamard(x):
    """``x @ H / sqrt(d)`` over the last dim (float32), with ``H`` the Sylvester Hadamard
    matrix (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``); ``d`` a power of two."""
    x = jnp.asarray(x, jnp.float32)
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: the last dim must be a power of two, got {d} (shape {tuple(x.shape)})")
    lead = x.shape[:-1]
    h = 1
    # Butterflies of additions only: exact to float32 rounding on every backend (no TF32 dot).
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x * (d ** -0.5)


def quantize_fp8(x, scale_fmt: str | None = "ue8m0"):
    """float8_e4m3fn codes ``[..., d]`` and float32 scales ``[...]`` (one per vector) of ``x``."""
    _check_scale_fmt(scale_fmt, "quantize_fp8")
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), _AMAX_FLOOR)
    scale = amax * jnp.float32(1.0 / FP8_MAX)
    if scale_fmt == "ue8m0":
        # 2 ** ceil(log2(scale)) from the bits (XLA's log2 is not exact on every backend);
        # scale is a normal float32 (>= 1e-4 / 448).
        bits = lax.bitcast_convert_type(scale, jnp.uint32)
        exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
        scale = _pow2_from_exponent(exponent)
    codes = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return codes, scale


def write_index_k(index_k, index_k_scale, k_new, slots, scale_fmt: str | None = "ue8m0"):
    """Quantize keys ``k_new [..., d]`` (float) and store codes and scales at token ``slots [...]``
    (``page * page_size + offset``; slots outside the cache are dropped). Returns the updated
    ``(index_k, index_k_scale)``; donate both under jit to update them in place."""
    fn = "write_index_k"
    index_k, index_k_scale = jnp.asarray(index_k), jnp.asarray(index_k_scale)
    k_new, slots = jnp.asarray(k_new), jnp.asarray(slots)
    if index_k.ndim != 3 or jnp.dtype(index_k.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"{fn}: index_k must be float8_e4m3fn [num_blocks, page_size, d], got "
                         f"{jnp.dtype(index_k.dtype).name} {tuple(index_k.shape)}")
    if tuple(index_k_scale.shape) != tuple(index_k.shape[:2]) or jnp.dtype(index_k_scale.dtype) != jnp.float32:
        raise ValueError(f"{fn}: index_k_scale must be float32 {tuple(index_k.shape[:2])} "
                         f"[num_blocks, page_size], got {jnp.dtype(index_k_scale.dtype).name} "
                         f"{tuple(index_k_scale.shape)}")
    d = index_k.shape[-1]
    if k_new.ndim < 1 or k_new.shape[-1] != d:
        raise ValueError(f"{fn}: k_new last dim must be {d} (index_k's), got shape {tuple(k_new.shape)}")
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise TypeError(f"{fn}: slots must have an integer dtype, got {jnp.dtype(slots.dtype).name}")
    if tuple(slots.shape) != tuple(k_new.shape[:-1]):
        raise ValueError(f"{fn}: slots shape must equal k_new.shape[:-1] = {tuple(k_new.shape[:-1])}, "
                         f"got {tuple(slots.shape)}")
    codes, scale = quantize_fp8(k_new.reshape(-1, d), scale_fmt)
    n_slots = index_k.shape[0] * index_k.shape[1]
    slots = slots.reshape(-1)
    slots = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots)  # out of range: dropped, not wrapped
    new_k = index_k.reshape(n_slots, d).at[slots].set(codes, mode="drop").reshape(index_k.shape)
    new_scale = index_k_scale.reshape(n_slots).at[slots].set(scale, mode="drop").reshape(index_k_scale.shape)
    return new_k, new_scale


def index_scores(q_codes, q_weight, k_codes, k_scale):
    """Scores ``[..., s, t]`` of queries ``q_codes [..., s, heads, d]`` (weighted per head by
    ``q_weight [..., s, heads]``) against keys ``k_codes [..., t, d]`` scaled by
    ``k_scale [..., t]``: ReLU'd dot products of the codes, weighted and summed over heads, times
    the key's scale."""
    # Products of FP8 codes are exact at any dot precision (TF32, bf16 passes); only the float32
    # sums round. The head weighting is not: HIGHEST keeps it float32 on GPUs and TPUs.
    logits = jnp.einsum("...shd,...td->...sht", q_codes.astype(jnp.float32), k_codes.astype(jnp.float32))
    return jnp.einsum("...sht,...sh->...st", jnp.maximum(logits, 0.0), q_weight,
                      precision=lax.Precision.HIGHEST) * k_scale[..., None, :]

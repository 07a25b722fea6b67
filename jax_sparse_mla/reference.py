"""The definition of sparse MLA decoding (docs/numerics.md) in plain JAX, float32 math.

Slow but simple: dequantize the whole cache, gather the listed tokens, softmax over them.
Every other implementation is tested against this one.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _ints
from .formats import D_V, KVFormat, _as_byte_cache, _in_range, dequantize_kv

__all__ = ["dequantized_tokens", "sparse_mla_decode"]


def dequantized_tokens(kv_cache, fmt=None):
    """The cache as bf16 key vectors ``[num_blocks * page_size, d_qk]``, indexed by token slot
    ``page * page_size + offset``."""
    keys = dequantize_kv(kv_cache, fmt)
    return keys.reshape(-1, keys.shape[-1])


def _check_int(x, name, shape):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"sparse_mla_decode: {name} must have an integer dtype (int32), got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"sparse_mla_decode: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _gather_list(kv_cache, indices, lengths, fmt, name, b, s_q):
    """Keys ``[b, s_q, n, d_qk]`` (float32) of one index list and its validity ``[b, s_q, n]``.

    Invalid entries (docs/formats.md, "Which entries are read") gather a clipped, arbitrary
    row; callers mask them.
    """
    prefix = "" if name == "main" else "extra_"
    cache, _ = _as_byte_cache(kv_cache, fmt, "sparse_mla_decode", f"{prefix}kv_cache")
    num_tokens = cache.shape[0] * cache.shape[1]
    indices = jnp.asarray(_ints.ids(f"{prefix}indices", indices, num_tokens))
    if indices.ndim != 3:
        raise ValueError(
            f"sparse_mla_decode: {prefix}indices must have rank 3 [b, s_q, {prefix}topk], "
            f"got shape {tuple(indices.shape)}"
        )
    topk = indices.shape[-1]
    _check_int(indices, f"{prefix}indices", (b, s_q, topk))

    tokens = dequantized_tokens(cache, fmt)

    valid = _in_range(indices, num_tokens)
    if lengths is not None:
        lengths = jnp.asarray(_ints.lengths_int32(lengths, topk))
        _check_int(lengths, f"{prefix}topk_length", (b,))
        n_used = jnp.clip(lengths.astype(jnp.int32), 0, topk)
        valid = valid & (jnp.arange(topk)[None, None, :] < n_used[:, None, None])

    safe = jnp.clip(indices, 0, max(num_tokens - 1, 0)).astype(jnp.int32)
    if num_tokens == 0:  # nothing can be valid; gather from a dummy row
        tokens = jnp.zeros((1, fmt.d_qk), tokens.dtype)
    keys = jnp.take(tokens, safe, axis=0).astype(jnp.float32)
    return keys, valid


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
    plan=None,
):
    """Sparse MLA decode, the reference.

    Args:
      q: ``[b, s_q, h_q, d_qk]`` bf16; ``d_qk`` picks the format (576 V32, 512 MODEL1).
      kv_cache: ``[num_blocks, page_size, bytes]`` or ``[num_blocks, page_size, 1, bytes]``
        cache bytes (uint8, int8 or float8_e4m3fn).
      indices: ``[b, s_q, topk]`` int32 token slots ``page * page_size + offset``.
      sm_scale: logit scale, default ``d_qk ** -0.5``.
      topk_length: optional ``[b]``; only the first ``topk_length[i]`` entries (clamped to
        ``[0, topk]``) of request ``i``'s rows count.
      attn_sink: optional ``[h_q]`` per-head sink logit.
      extra_kv_cache, extra_indices, extra_topk_length: an optional second list over its own
        cache, in the same softmax.
      plan: accepted for signature compatibility with the kernels and ignored.

    Returns:
      ``out [b, s_q, h_q, 512]`` bf16 and ``lse [b, h_q, s_q]`` float32 (natural log, sink
      excluded; ``+inf`` with ``out = 0`` for rows without a valid entry).
    """
    del plan
    q = jnp.asarray(q)
    if q.ndim != 4:
        raise ValueError(
            f"sparse_mla_decode: q must have rank 4 [b, s_q, h_q, d_qk], got shape {tuple(q.shape)}"
        )
    if jnp.dtype(q.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(f"sparse_mla_decode: q must have dtype bfloat16, got {jnp.dtype(q.dtype).name}")
    b, s_q, h_q, d_qk = q.shape
    fmt = KVFormat.from_d_qk(d_qk)
    if sm_scale is None:
        sm_scale = d_qk ** -0.5
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError(
            "sparse_mla_decode: extra_kv_cache and extra_indices must be given together, got "
            f"extra_kv_cache={'None' if extra_kv_cache is None else 'an array'}, "
            f"extra_indices={'None' if extra_indices is None else 'an array'}"
        )
    if extra_topk_length is not None and extra_indices is None:
        raise ValueError("sparse_mla_decode: extra_topk_length given without extra_indices")

    keys, valid = _gather_list(kv_cache, indices, topk_length, fmt, "main", b, s_q)
    if extra_kv_cache is not None:
        ekeys, evalid = _gather_list(
            extra_kv_cache, extra_indices, extra_topk_length, fmt, "extra", b, s_q
        )
        keys = jnp.concatenate([keys, ekeys], axis=2)
        valid = jnp.concatenate([valid, evalid], axis=2)
    # Invalid entries may have gathered NaN bytes: zero them (NaN * 0 would still be NaN).
    keys = jnp.where(valid[..., None], keys, 0.0)  # [b, s_q, n, d_qk]
    values = keys[..., :D_V]  # V = the first 512 dims of the key

    # z_j = sm_scale * <q, K_j>, fp32 accumulation.
    q32 = q.astype(jnp.float32)
    logits = jnp.einsum(
        "bshd,bsnd->bshn", q32, keys, precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    logits = logits * jnp.float32(sm_scale)
    mask = valid[:, :, None, :]  # [b, s_q, 1, n]
    logits = jnp.where(mask, logits, -jnp.inf)

    nonempty = jnp.any(mask, axis=-1)  # [b, s_q, 1]
    row_max = jnp.where(nonempty, jnp.max(logits, axis=-1, initial=-jnp.inf), 0.0)
    p = jnp.exp(logits - row_max[..., None])  # 0 for invalid entries
    denom = jnp.sum(p, axis=-1)
    safe_denom = jnp.where(nonempty, denom, 1.0)
    lse = jnp.where(nonempty, row_max + jnp.log(safe_denom), jnp.inf)  # [b, s_q, h_q]

    out = jnp.einsum(
        "bshn,bsnd->bshd", p / safe_denom[..., None], values, precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    if attn_sink is not None:
        sink = jnp.asarray(attn_sink).astype(jnp.float32)
        if sink.shape != (h_q,):
            raise ValueError(
                f"sparse_mla_decode: attn_sink must have shape ({h_q},), got {tuple(sink.shape)}"
            )
        # sink = +inf -> factor 0, -inf -> factor 1; empty rows are handled below.
        factor = 1.0 / (1.0 + jnp.exp(sink - jnp.where(nonempty, lse, 0.0)))
        out = out * factor[..., None]
    out = jnp.where(nonempty[..., None], out, 0.0)

    return out.astype(jnp.bfloat16), jnp.transpose(lse, (0, 2, 1))

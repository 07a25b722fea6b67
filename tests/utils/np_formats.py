"""An independent NumPy implementation of the cache formats (docs/formats.md).

It deliberately shares nothing with ``jax_sparse_mla``: ``np.frexp`` for the power-of-two scale,
ml_dtypes for the fp8/bf16 roundings."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn


# name: (d_qk, d_nope, tile, bytes_per_token)
LAYOUT = {"V32": (576, 512, 128, 656), "MODEL1": (512, 448, 64, 584)}


def fmt_name(fmt) -> str:
    """'V32' / 'MODEL1' for a KVFormat or a string."""
    return str(getattr(fmt, "name", fmt)).upper()


def np_quantize_tokens(k, fmt) -> np.ndarray:
    """bf16 ``[..., d_qk]`` -> uint8 token rows ``[..., bytes]`` (MODEL1: region A bytes, then
    the 7 scale bytes and a zero pad byte), straight from the formula in docs/formats.md."""
    name = fmt_name(fmt)
    d_qk, d_nope, tile, nbytes = LAYOUT[name]
    k = np.asarray(k)
    assert k.dtype == BF16 and k.shape[-1] == d_qk, (k.dtype, k.shape)
    lead = k.shape[:-1]
    x = k[..., :d_nope].astype(np.float32).reshape(*lead, d_nope // tile, tile)
    amax = np.abs(x).max(axis=-1)
    y = np.maximum(amax / np.float32(448.0), np.float32(1e-4)).astype(np.float32)
    mant, expo = np.frexp(y)  # y = mant * 2**expo, mant in [0.5, 1)
    log2_s = np.where(mant == 0.5, expo - 1, expo)  # ceil(log2(y)), exact
    s = np.ldexp(np.float32(1.0), log2_s).astype(np.float32)
    codes = (x / s[..., None]).astype(FP8).view(np.uint8).reshape(*lead, d_nope)
    rope = np.ascontiguousarray(k[..., d_nope:]).view(np.uint16).astype("<u2").view(np.uint8)
    rope = rope.reshape(*lead, 2 * (d_qk - d_nope))
    if name == "V32":
        scales = s.astype("<f4").view(np.uint8).reshape(*lead, 16)
        return np.concatenate([codes, scales, rope], axis=-1)
    ue8m0 = (log2_s + 127).astype(np.uint8)
    pad = np.zeros((*lead, 1), np.uint8)
    return np.concatenate([codes, rope, ue8m0, pad], axis=-1)


def np_rows_to_cache(rows, fmt) -> np.ndarray:
    """Token rows ``[nb, ps, bytes]`` -> cache bytes (MODEL1: page-planar)."""
    rows = np.asarray(rows)
    if fmt_name(fmt) == "V32":
        return rows.copy()
    nb, ps, nbytes = rows.shape
    cache = np.empty((nb, ps * nbytes), np.uint8)
    cache[:, : ps * 576] = rows[:, :, :576].reshape(nb, ps * 576)
    cache[:, ps * 576 :] = rows[:, :, 576:].reshape(nb, ps * 8)
    return cache.reshape(nb, ps, nbytes)


def np_cache_to_rows(cache, fmt) -> np.ndarray:
    """Cache bytes ``[nb, ps, bytes]`` (or ``[nb, ps, 1, bytes]``) -> token rows."""
    cache = np.asarray(cache).view(np.uint8)
    if cache.ndim == 4:
        cache = cache[:, :, 0, :]
    if fmt_name(fmt) == "V32":
        return cache
    nb, ps, nbytes = cache.shape
    flat = cache.reshape(nb, ps * nbytes)
    region_a = flat[:, : ps * 576].reshape(nb, ps, 576)
    region_b = flat[:, ps * 576 :].reshape(nb, ps, 8)
    return np.concatenate([region_a, region_b], axis=-1)


def np_quantize_kv(k, fmt) -> np.ndarray:
    """bf16 ``[nb, ps, d_qk]`` -> uint8 cache ``[nb, ps, bytes]``."""
    return np_rows_to_cache(np_quantize_tokens(k, fmt), fmt)


def np_token_fields(rows, fmt):
    """Token rows -> (codes as float32 ``[..., tiles, tile]``, float(bf16(scale)) ``[..., tiles]``,
    RoPE bf16 ``[..., d_qk - d_nope]``): the parts the dequantization rule combines."""
    name = fmt_name(fmt)
    d_qk, d_nope, tile, nbytes = LAYOUT[name]
    rows = np.asarray(rows).view(np.uint8)
    lead = rows.shape[:-1]
    codes = np.ascontiguousarray(rows[..., :d_nope]).view(FP8).astype(np.float32)
    codes = codes.reshape(*lead, d_nope // tile, tile)
    if name == "V32":
        scale = np.ascontiguousarray(rows[..., 512:528]).view("<f4").astype(np.float32)
        rope = rows[..., 528:656]
    else:
        e = rows[..., 576:583].astype(np.int64)
        with np.errstate(over="ignore"):
            scale = np.where(e == 255, np.nan, np.ldexp(1.0, e - 127)).astype(np.float32)
        rope = rows[..., 448:576]
    scale = scale.astype(BF16).astype(np.float32)
    rope = np.ascontiguousarray(rope).view("<u2").astype(np.uint16).view(BF16)
    return codes, scale, rope


def np_dequantize_tokens(rows, fmt) -> np.ndarray:
    """Token rows -> bf16 keys: ``bf16(float(code) * float(bf16(scale)))``, RoPE copied."""
    codes, scale, rope = np_token_fields(rows, fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        nope = (codes * scale[..., None]).astype(BF16).reshape(*codes.shape[:-2], -1)
    return np.concatenate([nope, rope], axis=-1)


def np_dequantize_kv(cache, fmt=None) -> np.ndarray:
    """Cache bytes -> bf16 ``[nb, ps, d_qk]``; ``fmt`` inferred from the last dim when None."""
    cache = np.asarray(cache)
    if fmt is None:
        fmt = "V32" if cache.shape[-1] == 656 else "MODEL1"
    return np_dequantize_tokens(np_cache_to_rows(cache, fmt), fmt)

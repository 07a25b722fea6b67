"""Shared test helpers: the tolerances (docs/numerics.md), conformance vectors, random cases,
independent NumPy implementations of the cache formats and of the op (float64), and the
multi-device layouts with the compiled-program check for collectives.

The NumPy code here deliberately shares nothing with ``jax_sparse_mla``: it follows
docs/formats.md and docs/numerics.md directly (``np.frexp`` for the power-of-two scale, ml_dtypes
for the fp8/bf16 roundings).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn

REPO_ROOT = Path(__file__).resolve().parents[1]


# ============================================================================================
# tolerances (docs/numerics.md, Tolerances)

OUT_ATOL = 1e-3
OUT_RTOL = 2.01 / 128
OUT_COS_DIFF = 5e-6
LSE_ATOL = 1e-6
LSE_RTOL = 8.01 / 65536


def _as_f64(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float64)


def _worst(a, r, bad, limit=5):
    """Text listing up to ``limit`` failing elements, largest error first."""
    idx = np.argwhere(bad)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - r)[bad]
    err = np.where(np.isnan(err), np.inf, err)
    order = np.argsort(-err, kind="stable")[:limit]
    lines = []
    for k in order:
        pos = tuple(int(v) for v in idx[k])
        lines.append(f"    at {pos}: actual={a[pos]!r} expected={r[pos]!r} |diff|={err[k]:.3g}")
    return "\n".join(lines)


def out_of_tolerance(a, r, atol, rtol):
    """Elementwise tolerance rule on float64 arrays: the mask of elements failing
    ``|a-r| <= atol or <= rtol*|r|`` (infinities must match, NaN never passes)."""
    nan = np.isnan(a) | np.isnan(r)
    inf = np.isinf(a) | np.isinf(r)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - r)
        close = (diff <= atol) | (diff <= rtol * np.abs(r))
    return ~(np.where(inf, a == r, close) & ~nan)


def _elementwise(actual, ref, atol, rtol, what):
    a, r = _as_f64(actual), _as_f64(ref)
    if a.shape != r.shape:
        raise AssertionError(f"{what}: shape mismatch, actual {a.shape} vs expected {r.shape}")
    bad = out_of_tolerance(a, r, atol, rtol)
    if bad.any():
        nan = np.isnan(a) | np.isnan(r)
        inf = np.isinf(a) | np.isinf(r)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.size} elements out of tolerance "
            f"(|diff| <= {atol:g} or <= {rtol:.6g}*|expected|; infinities must match; NaN never "
            f"passes; {int((nan & bad).sum())} NaN, {int((inf & bad).sum())} inf mismatches). "
            f"Worst:\n{_worst(a, r, bad)}"
        )
    return a, r, np.isinf(a) | np.isinf(r)


def assert_out_close(actual, ref):
    """Tolerance check of ``out``: elementwise tolerance plus the whole-tensor
    ``1 - 2*sum(a*r)/sum(a^2+r^2) < 5e-6`` (float64, over the finite elements)."""
    a, r, inf = _elementwise(actual, ref, OUT_ATOL, OUT_RTOL, "out")
    a, r = a[~inf], r[~inf]
    denom = float(np.sum(a * a + r * r))
    cos_diff = 0.0 if denom == 0.0 else 1.0 - 2.0 * float(np.sum(a * r)) / denom
    if not cos_diff < OUT_COS_DIFF:
        raise AssertionError(
            f"out: whole-tensor cosine difference {cos_diff:.3g} >= {OUT_COS_DIFF:g} "
            f"(max |diff| {float(np.max(np.abs(a - r), initial=0.0)):.3g})"
        )


def assert_lse_close(actual, ref):
    """Tolerance check of ``lse``: ``|a-r| <= 1e-6`` or ``<= 8.01/65536*|r|``, infinities
    equal, NaN fails."""
    _elementwise(actual, ref, LSE_ATOL, LSE_RTOL, "lse")


# ============================================================================================
# conformance vectors (docs/numerics.md, Conformance vectors)


def _find_conformance_dir():
    cand = REPO_ROOT / "tests" / "conformance_vectors"
    return cand if cand.is_dir() and any(cand.glob("*.npz")) else None


#: Directory of the FlashMLA conformance vectors, or None when it holds none.
CONFORMANCE_DIR = _find_conformance_dir()


def conformance_files():
    """Sorted list of the ``*.npz`` conformance vectors (empty when there are none)."""
    if CONFORMANCE_DIR is None:
        return []
    return sorted(CONFORMANCE_DIR.glob("*.npz"))


def _bf16_from_bytes(raw: np.ndarray, shape) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view("<u2").view(BF16).reshape(tuple(shape))


def load_conformance(path):
    """Load one vector. Returns a dict of jnp arrays:

    ``q`` bf16 ``[b, s_q, h_q, d_qk]``, ``kv`` uint8 ``kv_shape``, ``indices`` int32,
    ``sm_scale`` (python float), ``topk_length`` / ``attn_sink`` / ``extra_kv`` /
    ``extra_indices`` / ``extra_topk_length`` (None when absent), ``out`` bf16 ``out_shape``,
    ``lse`` float32 ``[b, h_q, s_q]``; also ``name`` (file stem) and, when stored, FlashMLA's
    ``sched_meta`` / ``num_splits`` / ``lse_ref``.
    """
    path = Path(path)
    with np.load(path) as z:
        d = {k: z[k] for k in z.files}
    v = {"name": path.stem}
    v["q"] = jnp.asarray(_bf16_from_bytes(d["q"], d["q_shape"]))
    v["kv"] = jnp.asarray(d["kv"].view(np.uint8).reshape(tuple(d["kv_shape"])))
    v["indices"] = jnp.asarray(d["indices"].astype(np.int32))
    v["sm_scale"] = float(d["sm_scale"])
    v["topk_length"] = jnp.asarray(d["topk_length"].astype(np.int32)) if "topk_length" in d else None
    v["attn_sink"] = jnp.asarray(d["attn_sink"].astype(np.float32)) if "attn_sink" in d else None
    if "extra_kv" in d:
        shape = tuple(d["extra_kv_shape"]) if "extra_kv_shape" in d else d["extra_kv"].shape
        v["extra_kv"] = jnp.asarray(d["extra_kv"].view(np.uint8).reshape(shape))
        v["extra_indices"] = jnp.asarray(d["extra_indices"].astype(np.int32))
    else:
        v["extra_kv"] = v["extra_indices"] = None
    v["extra_topk_length"] = (
        jnp.asarray(d["extra_topk_length"].astype(np.int32)) if "extra_topk_length" in d else None
    )
    v["out"] = jnp.asarray(_bf16_from_bytes(d["out"], d["out_shape"]))
    v["lse"] = jnp.asarray(d["lse"].astype(np.float32))
    for k in ("sched_meta", "num_splits", "lse_ref"):
        if k in d:
            v[k] = jnp.asarray(d[k])
    return v


def conformance_kwargs(v):
    """The keyword arguments of ``sparse_mla_decode`` for a loaded vector (absent ones left out)."""
    kw = {"q": v["q"], "kv_cache": v["kv"], "indices": v["indices"], "sm_scale": v["sm_scale"]}
    for src, dst in (
        ("topk_length", "topk_length"),
        ("attn_sink", "attn_sink"),
        ("extra_kv", "extra_kv_cache"),
        ("extra_indices", "extra_indices"),
        ("extra_topk_length", "extra_topk_length"),
    ):
        if v.get(src) is not None:
            kw[dst] = v[src]
    return kw


# ============================================================================================
# independent NumPy cache formats (docs/formats.md)

# name: (d_qk, d_nope, tile, bytes_per_token)
_LAYOUT = {"V32": (576, 512, 128, 656), "MODEL1": (512, 448, 64, 584)}


def fmt_name(fmt) -> str:
    """'V32' / 'MODEL1' for a KVFormat or a string."""
    return str(getattr(fmt, "name", fmt)).upper()


def np_quantize_tokens(k, fmt) -> np.ndarray:
    """bf16 ``[..., d_qk]`` -> uint8 token rows ``[..., bytes]`` (MODEL1: region A bytes, then
    the 7 scale bytes and a zero pad byte), straight from the formula in docs/formats.md."""
    name = fmt_name(fmt)
    d_qk, d_nope, tile, nbytes = _LAYOUT[name]
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


def np_dequantize_tokens(rows, fmt) -> np.ndarray:
    """Token rows -> bf16 keys: ``bf16(float(code) * float(bf16(scale)))``, RoPE copied."""
    name = fmt_name(fmt)
    d_qk, d_nope, tile, nbytes = _LAYOUT[name]
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
    with np.errstate(invalid="ignore", over="ignore"):
        nope = (codes * scale[..., None]).astype(BF16).reshape(*lead, d_nope)
    rope = np.ascontiguousarray(rope).view("<u2").astype(np.uint16).view(BF16)
    return np.concatenate([nope, rope], axis=-1)


def np_dequantize_kv(cache, fmt=None) -> np.ndarray:
    """Cache bytes -> bf16 ``[nb, ps, d_qk]``; ``fmt`` inferred from the last dim when None."""
    cache = np.asarray(cache)
    if fmt is None:
        fmt = "V32" if cache.shape[-1] == 656 else "MODEL1"
    return np_dequantize_tokens(np_cache_to_rows(cache, fmt), fmt)


# ============================================================================================
# independent float64 reference of the op (docs/numerics.md)


def _valid_mask(indices, lengths, num_tokens):
    b, s_q, topk = indices.shape
    lens = np.full(b, topk) if lengths is None else np.clip(np.asarray(lengths, np.int64), 0, topk)
    t = np.arange(topk)
    idx = indices.astype(np.int64)
    return (t[None, None, :] < lens[:, None, None]) & (idx >= 0) & (idx < num_tokens)


def _np_rows(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, extra_topk_length):
    """The rows of the op with at least one valid entry, in float64: yields ``(i, s, keys [J, d_qk],
    p [J, h_q], lse [h_q])`` (the valid entries' keys, their softmax, its log-sum-exp)."""
    q = np.asarray(q)
    b, s_q, h_q, d_qk = q.shape
    q64 = q.astype(np.float64)
    fmt = {576: "V32", 512: "MODEL1"}[d_qk]
    scale = d_qk ** -0.5 if sm_scale is None else float(sm_scale)

    lists = []
    for cache, idx, lens in ((kv_cache, indices, topk_length),
                             (extra_kv_cache, extra_indices, extra_topk_length)):
        if cache is None or idx is None:
            continue
        tokens = np_dequantize_kv(cache, fmt).reshape(-1, d_qk)
        idx = np.asarray(idx)
        lists.append((tokens, idx, _valid_mask(idx, lens, tokens.shape[0])))

    for i in range(b):
        for s in range(s_q):
            rows = [tok[idx[i, s][ok[i, s]]] for tok, idx, ok in lists]
            keys = np.concatenate(rows, axis=0).astype(np.float64) if rows else np.zeros((0, d_qk))
            if keys.shape[0] == 0:
                continue
            z = scale * (keys @ q64[i, s].T)  # [J, h_q]
            m = z.max(axis=0)
            row_lse = m + np.log(np.exp(z - m).sum(axis=0))
            yield i, s, keys, np.exp(z - row_lse), row_lse


def np_sparse_mla_decode(q, kv_cache, indices, *, sm_scale=None, topk_length=None, attn_sink=None,
                         extra_kv_cache=None, extra_indices=None, extra_topk_length=None, plan=None,
                         abs_values=False):
    """Loop-over-rows float64 implementation. Returns ``(out [b,s_q,h_q,512], lse [b,h_q,s_q])``
    as float64 NumPy arrays (``out`` not rounded to bf16). ``abs_values``: ``out`` holds
    sum_j p_j |V_j| instead, the scale of the error that bf16 probabilities (docs/numerics.md) allow."""
    b, s_q, h_q, _ = np.shape(q)
    out = np.zeros((b, s_q, h_q, 512))
    lse = np.full((b, h_q, s_q), np.inf)
    for i, s, keys, p, row_lse in _np_rows(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache,
                                           extra_indices, extra_topk_length):
        values = np.abs(keys[:, :512]) if abs_values else keys[:, :512]
        o = p.T @ values  # [h_q, 512]
        if attn_sink is not None:
            sink = np.asarray(attn_sink, np.float64)
            with np.errstate(over="ignore"):
                o = o / (1.0 + np.exp(sink - row_lse))[:, None]
        out[i, s] = o
        lse[i, :, s] = row_lse
    return out, lse


def np_logit_sensitivity(q, kv_cache, indices, *, sm_scale=None, topk_length=None, extra_kv_cache=None,
                         extra_indices=None, extra_topk_length=None, **_):
    """How much fp32 logits can move ``out`` (no sink): ``(dispersion [b,s_q,h_q,512],
    magnitude [b,s_q,h_q])`` in float64, where dispersion = sum_j p_j |V_j - out| and magnitude =
    max_j sm_scale * sum_d |q_d K_jd|, the size the fp32 sums of a row's logits run up to.
    Logit errors of at most eps per entry change every p_j by a factor within e^(+-2 eps), hence
    ``out`` by at most expm1(2 eps) * dispersion (the p_j sum to 1 on both sides)."""
    b, s_q, h_q, d_qk = np.shape(q)
    scale = d_qk ** -0.5 if sm_scale is None else float(sm_scale)
    q64 = np.abs(np.asarray(q).astype(np.float64))
    dispersion = np.zeros((b, s_q, h_q, 512))
    magnitude = np.zeros((b, s_q, h_q))
    for i, s, keys, p, _ in _np_rows(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache,
                                     extra_indices, extra_topk_length):
        v = keys[:, :512]
        o = p.T @ v  # [h_q, 512]
        dispersion[i, s] = np.einsum("jh,jhd->hd", p, np.abs(v[:, None, :] - o[None]))
        magnitude[i, s] = (scale * (np.abs(keys) @ q64[i, s].T)).max(axis=0)
    return dispersion, magnitude


# ============================================================================================
# random cases


def _bad_values(num_tokens):
    """Out-of-range index values of every kind."""
    i32 = np.iinfo(np.int32)
    return np.array([-1, i32.min, min(num_tokens, i32.max), min(num_tokens + 7, i32.max), i32.max],
                    np.int64)


def _random_keys(rng, name, num_blocks, page_size):
    """bf16 keys with per-tile magnitudes spread over a range, some all-zero and some tiny tiles."""
    d_qk, d_nope, tile, _ = _LAYOUT[name]
    n_tiles = d_nope // tile
    k = rng.standard_normal((num_blocks, page_size, d_qk), dtype=np.float32)
    mag = np.exp(rng.uniform(-1.0, 1.0, (num_blocks, page_size, n_tiles))).astype(np.float32)
    special = rng.random((num_blocks, page_size, n_tiles))
    mag[special < 0.02] = 0.0
    mag[(special >= 0.02) & (special < 0.04)] = 1e-6
    k[..., :d_nope] *= np.repeat(mag, tile, axis=-1)
    return k.astype(BF16)


def _random_list(rng, b, s_q, topk, num_tokens, invalid_fraction, duplicates):
    """``[b, s_q, topk]`` int32 mixing valid tokens, duplicates and every kind of bad value."""
    n = b * s_q * topk
    idx = rng.integers(0, num_tokens, size=n, dtype=np.int64)
    if duplicates and topk > 1:
        idx = idx.reshape(b * s_q, topk)
        dup = rng.random(idx.shape) < 0.15
        src = rng.integers(0, topk, size=idx.shape)
        rows = np.arange(b * s_q)[:, None].repeat(topk, axis=1)
        idx = np.where(dup, idx[rows, src], idx).reshape(-1)
    n_bad = int(round(invalid_fraction * n))
    if n_bad:
        pos = rng.choice(n, size=n_bad, replace=False)
        bad = _bad_values(num_tokens)
        idx[pos] = bad[rng.permutation(n_bad) % len(bad)]  # every kind once n_bad >= 5
    return idx.reshape(b, s_q, topk).astype(np.int32)


def _random_lengths(rng, b, topk, out_of_range):
    lens = rng.integers(0, topk + 1, size=b)
    if b >= 2:
        lens[0], lens[1] = topk, 0  # full and empty
    elif b == 1:
        lens[0] = topk
    if out_of_range and b >= 4:
        lens[3] = -5 if rng.random() < 0.5 else topk + 9  # clamped
    return lens.astype(np.int32)


def make_case(rng, fmt, *, b, s_q, h_q, topk, page_size, num_blocks, extra_topk=0,
              extra_page_size=None, extra_num_blocks=None, with_lengths=False, with_sink=False,
              invalid_fraction=0.1, duplicates=True, empty_row=False, lengths_out_of_range=True,
              nan_fill=True, sm_scale="random"):
    """Fresh random keyword arguments for ``sparse_mla_decode``.

    ``q`` (bf16, std 1), ``kv_cache`` (uint8, keys quantized per docs/formats.md) and ``indices``
    (valid tokens, duplicates when ``duplicates``, and ``invalid_fraction`` of out-of-range values
    of every kind: -1, -2**31, num_tokens, num_tokens+7, 2**31-1). Optional keys appear only when
    used: ``topk_length`` / ``extra_topk_length`` (``with_lengths``: request 0 full, request 1
    empty, request 3 out of ``[0, topk]`` when ``lengths_out_of_range``), ``attn_sink``
    (``with_sink``: head 1 is +inf, head 2 is -inf), the extra cache (``extra_topk > 0``) and
    ``sm_scale`` (a python float; ``"random"`` includes it half the time, None never, a number
    always). ``empty_row`` makes row ``(b-1, s_q-1)`` invalid in both lists. With ``nan_fill``
    every cache slot that no valid entry references holds 0xFF bytes (fp8 NaN codes, NaN scales),
    as in the conformance vectors.
    """
    name = fmt_name(fmt)
    d_qk = _LAYOUT[name][0]
    case = {"q": rng.standard_normal((b, s_q, h_q, d_qk), dtype=np.float32).astype(BF16)}

    specs = [("", topk, page_size, num_blocks)]
    if extra_topk > 0:
        specs.append(("extra_", extra_topk, extra_page_size or page_size,
                      extra_num_blocks or num_blocks))
    for prefix, tk, ps, nb in specs:
        num_tokens = nb * ps
        idx = _random_list(rng, b, s_q, tk, num_tokens, invalid_fraction, duplicates)
        if empty_row and tk > 0:
            bad = _bad_values(num_tokens)
            idx[b - 1, s_q - 1] = bad[rng.integers(0, len(bad), size=tk)]
        lens = _random_lengths(rng, b, tk, lengths_out_of_range) if with_lengths else None
        rows = np_quantize_tokens(_random_keys(rng, name, nb, ps), name)
        if nan_fill:
            used = np.zeros(num_tokens, bool)
            used[idx[_valid_mask(idx, lens, num_tokens)]] = True
            rows.reshape(num_tokens, -1)[~used] = 0xFF
        case[f"{prefix}kv_cache" if prefix else "kv_cache"] = np_rows_to_cache(rows, name)
        case[f"{prefix}indices"] = idx
        if lens is not None:
            case[f"{prefix}topk_length"] = lens

    if with_sink:
        sink = rng.normal(2.0, 2.0, size=h_q).astype(np.float32)
        if h_q >= 2:
            sink[1] = np.inf
        if h_q >= 3:
            sink[2] = -np.inf
        case["attn_sink"] = sink

    out = {k: jnp.asarray(v) for k, v in case.items()}
    if sm_scale == "random":
        sm_scale = float(d_qk ** -0.5 * rng.uniform(0.5, 1.5)) if rng.random() < 0.5 else None
    if sm_scale is not None:
        out["sm_scale"] = float(sm_scale)
    return out


# The GPU path rounds the probabilities to bf16 before P·V, as FlashMLA does (docs/numerics.md). That
# rounding moves an output element by up to about 2^-9 * sum_j p_j |V_j|, and the absolute
# tolerance (1e-3) was set by FlashMLA on data with |V| around 0.1. make_case draws |V| up to ~9,
# where the GPU path's exact numerics (emulated in NumPy) already miss 1e-3 on ~0.3% of the elements
# (max |diff| ~0.015). So the comparisons below first scale every cached value by 2^-6 and q by
# 2^6: exact in fp8 scales and bf16, same logits and softmax, FlashMLA-like |V|. The unscaled
# data is checked too, with the bound that bf16 probabilities allow (test_gpu.py,
# test_unscaled_make_case_data). Used by the tests of every bf16-probability path.
SOFTEN_SHIFT = 6


def _scale_cache(cache, fmt, shift):
    """Cache bytes with every dequantized value multiplied by 2^-shift (exactly): the scales
    (V32 float32 / MODEL1 UE8M0 exponents) and the bf16 RoPE dims. NaN bytes stay NaN."""
    cache = np.array(cache, copy=True).view(np.uint8)
    nb, ps = cache.shape[0], cache.shape[1]
    factor = np.float32(2.0 ** -shift)

    def scale_bf16(b):  # [..., 2k] little-endian bf16 bytes
        v = np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16
        f = v.view(np.float32) * factor
        return (f.view(np.uint32) >> 16).astype("<u2").view(np.uint8).reshape(b.shape)

    if fmt == "V32":
        rows = cache.reshape(-1, 656)
        sc = np.ascontiguousarray(rows[:, 512:528]).view("<f4") * factor
        rows[:, 512:528] = sc.astype("<f4").view(np.uint8)
        rows[:, 528:656] = scale_bf16(rows[:, 528:656])
        return rows.reshape(cache.shape)
    flat = cache.reshape(nb, ps * 584)
    region_a = flat[:, : ps * 576].reshape(nb, ps, 576)
    region_a[:, :, 448:576] = scale_bf16(region_a[:, :, 448:576])
    flat[:, : ps * 576] = region_a.reshape(nb, ps * 576)
    region_b = flat[:, ps * 576 :].reshape(nb, ps, 8)
    e = region_b[:, :, :7].astype(np.int32)
    region_b[:, :, :7] = np.where(e == 255, 255, np.maximum(e - shift, 0)).astype(np.uint8)
    flat[:, ps * 576 :] = region_b.reshape(nb, ps * 8)
    return flat.reshape(cache.shape)


def soften(case, shift=SOFTEN_SHIFT):
    """The same attention problem with |V| scaled by 2^-shift (q scaled up to keep the logits)."""
    case = dict(case)
    fmt = "V32" if case["q"].shape[-1] == 576 else "MODEL1"
    case["q"] = (case["q"].astype(jnp.float32) * (2.0 ** shift)).astype(jnp.bfloat16)
    for key in ("kv_cache", "extra_kv_cache"):
        if key in case:
            case[key] = jnp.asarray(_scale_cache(np.asarray(case[key]), fmt, shift))
    return case


def fresh_rng():
    """A generator with a fresh seed every run; the seed is printed, so a failure shows it."""
    seed = np.random.SeedSequence().entropy % (2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


# ============================================================================================
# multi-device layouts and collectives in compiled programs

_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
                         r"(?:-start)?\(")


def collectives(hlo: str, min_elements: int = 0) -> list[str]:
    """The collective instructions of a compiled program (``compiled.as_text()``) whose result
    holds an array of at least ``min_elements`` elements (0: every collective; a cache's size:
    the cache, or a reshape of it, moved between devices). Async ``*-start`` forms count."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", m.group(1))]
        if max(sizes, default=1) >= min_elements:
            found.append(line.strip())
    return found


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit``."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def mesh_layouts(n: int, heads: int) -> dict:
    """(dp, tp) of the multi-device layouts on ``n`` devices: ``"tp"`` heads split over all of
    them (as far as ``heads`` divides), ``"dp"`` requests split ``n`` ways, and ``"dp2_tp"``
    DP 2 x TP n/2 (same caveat; only for an even ``n >= 4``)."""
    layouts = {"tp": (1, largest_divisor(heads, n)), "dp": (n, 1)}
    if n >= 4 and n % 2 == 0:
        layouts["dp2_tp"] = (2, largest_divisor(heads, n // 2))
    return layouts

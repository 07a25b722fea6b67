"""Random cases: fresh keyword arguments for ``sparse_mla_decode``, and the same problem with
smaller values (``soften``)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from tests.utils.np_formats import BF16, LAYOUT, fmt_name, np_quantize_tokens, np_rows_to_cache
from tests.utils.np_reference import valid_mask


def _bad_values(num_tokens):
    """Out-of-range index values of every kind."""
    i32 = np.iinfo(np.int32)
    return np.array([-1, i32.min, min(num_tokens, i32.max), min(num_tokens + 7, i32.max), i32.max],
                    np.int64)


def random_keys(rng, name, num_blocks, page_size):
    """bf16 keys with per-tile magnitudes spread over a range, some all-zero and some tiny tiles."""
    d_qk, d_nope, tile, _ = LAYOUT[name]
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
    d_qk = LAYOUT[name][0]
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
        rows = np_quantize_tokens(random_keys(rng, name, nb, ps), name)
        if nan_fill:
            used = np.zeros(num_tokens, bool)
            used[idx[valid_mask(idx, lens, num_tokens)]] = True
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


def stale_lengths_case(rng, fmt, h_q):
    """The stale-plan case: 5 requests of 320 entries, every entry a real token (an entry past a
    length could point at NaN bytes that other lengths would read), softened, with a sink. Returns
    ``(case, old, new, extra)``: the lengths the plan is made for, the lengths of the call (3
    requests moved by whole blocks, mostly to other block counts; the last request always longer,
    so the last worker's end is certainly stale) and MODEL1's extra lengths (else None). The case
    itself has no lengths."""
    b, topk = 5, 320
    model1 = fmt_name(fmt) == "MODEL1"
    case = soften(make_case(rng, fmt, b=b, s_q=2, h_q=h_q, topk=topk, page_size=64, num_blocks=40,
                            extra_topk=100 if model1 else 0, extra_page_size=64, extra_num_blocks=8,
                            with_sink=True))
    old = rng.integers(0, topk + 1, size=b)
    new = old.copy()
    moved = rng.choice(b, size=3, replace=False)
    new[moved] = (old[moved] + 64 * rng.integers(1, 4, size=3)) % (topk + 1)
    old[-1], new[-1] = 10, topk
    extra = np.full(b, 100) if model1 else None
    return case, old, new, extra


def fresh_rng():
    """A generator with a fresh seed every run; the seed is printed, so a failure shows it.
    JSM_SEED=N replays a failure's seed."""
    replay = os.environ.get("JSM_SEED")
    seed = int(replay) if replay else np.random.SeedSequence().entropy % (2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)

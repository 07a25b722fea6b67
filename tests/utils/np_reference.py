"""An independent float64 NumPy reference of the op (docs/numerics.md)."""

from __future__ import annotations

import numpy as np

from tests.utils.np_formats import np_dequantize_kv


def valid_mask(indices, lengths, num_tokens):
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
        lists.append((tokens, idx, valid_mask(idx, lens, tokens.shape[0])))

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

"""CPU check of the f16-product variant's numerics (`benchmarks/patches/small_rs5.patch`, NOTES
session 20) on tests/test_gpu.py::test_non_power_of_two_v32_scales's inputs, at 16 and 64 heads:
the largest excess of out over the test's bound and of |lse error| over assert_lse_close's
tolerance, for a NumPy model of that variant's arithmetic and one of the shipped kernels' rule.

    python benchmarks/emulate_f16_products.py --seeds 0:25

Models (sums in float64, rounded to fp32 where the kernels hold fp32; one split piece per
64-entry block, merged as combine.cu does):
  rule: K and V = bf16(code * bf16(scale)) (kv_format.h), P rounded to bf16;
  f16:  S = sum over scale tiles of bf16(scale) * (q' . codes) with q' = f16(q * 2^k) * 2^-k per
        head (no rounding of K), RoPE dims as stored; V = f16(code * bf16(scale) / c) * c with c
        a power of two per block and scale tile (the variant's running maximum, one block); P in f16.
Non-power-of-two scales are where the two differ (with powers of two both are exact).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_sparse_mla import reference  # noqa: E402
from tests.test_gpu import v32_scales_bound, v32_scales_case  # noqa: E402
from tests.utils.tolerances import LSE_ATOL, LSE_RTOL  # noqa: E402

BF16, F16, F32 = ml_dtypes.bfloat16, np.float16, np.float32
TILES, TILE = 4, 128  # V32 scale tiles of the 512 NoPE dims


def _fields(kv):
    """V32 rows -> codes [n, 512] (exact), bf16(scale) [n, 4], RoPE [n, 64], as float64."""
    rows = kv.reshape(-1, 656)
    codes = rows[:, :512].copy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = rows[:, 512:528].copy().view("<f4").astype(BF16).astype(np.float64)
    rope = (rows[:, 528:656].copy().view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return codes, scales, rope


def _q_f16(q_nope):
    """Per head: q * 2^k in f16 (k puts the largest |q| in [2^14, 2^15)), back as q' * 2^-k."""
    mx = np.abs(q_nope).max(axis=-1, keepdims=True)
    k = np.where(mx > 0, np.minimum(14 - np.floor(np.log2(np.where(mx > 0, mx, 1.0))), 125), 0)
    return (q_nope * np.exp2(k)).astype(F16).astype(np.float64) * np.exp2(-k)


def _values_f16(codes, scales):
    """code * (bf16(scale) / c) in f16, times c: c the power of two >= each block's largest scale."""
    out = np.empty_like(codes)
    for b0 in range(0, codes.shape[0], 64):
        s = scales[b0:b0 + 64]
        c = np.exp2(np.ceil(np.log2(np.maximum(np.abs(s).max(axis=0), 2.0 ** -126))))
        v = codes[b0:b0 + 64].reshape(-1, TILES, TILE) * (s / c)[:, :, None]
        out[b0:b0 + 64] = (v.astype(F16).astype(np.float64) * c[None, :, None]).reshape(-1, 512)
    return out


def model_decode(case, model):
    """out [b, s_q, h, 512] (bf16 values) and lse [b, h, s_q] of one model."""
    q = np.asarray(case["q"]).astype(np.float32).astype(np.float64)
    codes, scales, rope = _fields(np.asarray(case["kv_cache"]))
    idx = np.asarray(case["indices"])
    c2 = float(F32(case["sm_scale"]) * F32(np.log2(np.e)))
    b, s_q, h, _ = q.shape
    out, lse = np.zeros((b, s_q, h, 512)), np.zeros((b, h, s_q))
    p_type = F16 if model == "f16" else BF16
    for i in range(b):
        for s in range(s_q):
            cd, sg, rp, qi = codes[idx[i, s]], scales[idx[i, s]], rope[idx[i, s]], q[i, s]
            if model == "f16":
                part = np.einsum("ntd,htd->nht", cd.reshape(-1, TILES, TILE), _q_f16(qi[:, :512]).reshape(h, TILES, TILE))
                logits = (part * sg[:, None, :]).sum(-1) + rp @ qi[:, 512:].T
                values = _values_f16(cd, sg)
            else:
                keys = (cd.reshape(-1, TILES, TILE) * sg[:, :, None]).astype(BF16).astype(np.float64).reshape(-1, 512)
                logits = keys @ qi[:, :512].T + rp @ qi[:, 512:].T
                values = keys
            x = logits.astype(F32).astype(np.float64) * c2
            lse2, outs = [], []
            for b0 in range(0, x.shape[0], 64):
                xb = x[b0:b0 + 64]
                m = xb.max(axis=0)
                p = np.exp2(xb - m)
                l_sum = p.sum(axis=0)
                outs.append(p.astype(p_type).astype(np.float64).T @ values[b0:b0 + 64] / l_sum[:, None])
                lse2.append(np.log2(l_sum) + m)
            lk = np.stack(lse2)
            g = np.log2(np.exp2(lk - lk.max(0)).sum(0)) + lk.max(0)
            out[i, s] = sum(np.exp2(lp - g)[:, None] * o for lp, o in zip(lse2, outs)).astype(BF16)
            lse[i, :, s] = g / np.log2(np.e)
    return out, lse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:25", help="START:STOP")
    args = ap.parse_args(argv)
    seeds = range(*map(int, args.seeds.split(":")))
    ref = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))
    failed = False
    for h_q in (16, 64):
        worst = {m: [-np.inf, 0.0] for m in ("rule", "f16")}
        for seed in seeds:
            case = v32_scales_case(np.random.default_rng(seed), h_q)
            ref_out, ref_lse = ref(**case)
            r = np.asarray(ref_out.astype(np.float32)).astype(np.float64)
            rl = np.asarray(ref_lse).astype(np.float64)
            bound = v32_scales_bound(case, r)
            lse_tol = np.maximum(LSE_ATOL, LSE_RTOL * np.abs(rl))
            for m in worst:
                a, al = model_decode(case, m)
                excess = np.abs(a - r) - bound
                worst[m][0] = max(worst[m][0], float(np.nan if np.isnan(excess).any() else excess.max()))
                worst[m][1] = max(worst[m][1], float(np.max(np.abs(al - rl) / lse_tol)))
        print(f"h_q {h_q}, seeds {seeds.start}:{seeds.stop}: per model, the largest out excess over the "
              f"test's bound (<= 0 holds) and |lse error| / tolerance (<= 1 holds): {worst}", flush=True)
        failed |= any(not (v[0] <= 0 and v[1] <= 1) for v in worst.values())
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())

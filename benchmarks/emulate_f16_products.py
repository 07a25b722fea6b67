"""CPU check of the f16 products' numerics (the V32 few-heads kernel, ffi/cuda/decode_small_rs.cuh;
docs/numerics.md) on tests/test_gpu.py::test_non_power_of_two_v32_scales's inputs, at 16 and 64 heads:
the largest excess of out over the test's bound and of |lse error| over assert_lse_close's
tolerance, for a NumPy model of that kernel's arithmetic and one of the bf16 rule of the other kernels.

    python benchmarks/emulate_f16_products.py --seeds 0:25

Models (logits summed in float64 and rounded to fp32; the softmax, P V and the merge of one split
piece per 64-entry block are emulate_v32_scales.py's `decode_pieces`):
  rule: K and V = bf16(code * bf16(scale)) (kv_format.h), P rounded to bf16;
  f16:  S = sum over scale tiles of bf16(scale) * (q' . codes) with q' = f16(q * 2^k) * 2^-k per
        head (no rounding of K), RoPE dims as stored; V = f16(code * bf16(scale) / c) * c (one
        rounding) with c the power of two at or above the block's largest scale, per scale tile;
        P in f16. (The kernel first rounded bf16(scale) / c to f16 on its own: that flushed the
        tokens of scales 2^24 below a block's largest, and this model, then one rounding
        behind, missed it; NOTES session 21.)
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

from benchmarks.emulate_v32_scales import decode_pieces, dot_f32  # noqa: E402
from jax_sparse_mla import reference  # noqa: E402
from tests.test_gpu import v32_scales_bound, v32_scales_case  # noqa: E402
from tests.utils import np_dequantize_kv  # noqa: E402
from tests.utils.np_formats import np_cache_to_rows, np_token_fields  # noqa: E402
from tests.utils.tolerances import LSE_ATOL, LSE_RTOL, out_of_tolerance  # noqa: E402

BF16, F16, F32 = ml_dtypes.bfloat16, np.float16, np.float32


def _q_f16(q_nope):
    """Per head: q * 2^k in f16 (k puts the largest |q| in [2^14, 2^15)), back as q' * 2^-k."""
    mx = np.abs(q_nope).max(axis=-1, keepdims=True)
    k = np.where(mx > 0, np.minimum(14 - np.floor(np.log2(np.where(mx > 0, mx, 1.0))), 125), 0)
    return (q_nope * np.exp2(k)).astype(F16).astype(np.float64) * np.exp2(-k)


def _values_f16(codes, scales):
    """code * (bf16(scale) / c) in f16, times c: c the power of two >= each block's largest
    scale, per scale tile. codes [n, tiles, tile], scales [n, tiles] -> [n, tiles * tile]."""
    out = np.empty(codes.shape)
    for b0 in range(0, codes.shape[0], 64):
        s = scales[b0:b0 + 64].astype(np.float64)
        c = np.exp2(np.ceil(np.log2(np.maximum(np.abs(s).max(axis=0), 2.0 ** -126))))
        v = codes[b0:b0 + 64] * (s / c)[:, :, None]
        out[b0:b0 + 64] = v.astype(F16).astype(np.float64) * c[None, :, None]
    return out.reshape(codes.shape[0], -1)


def model_decode(case, model):
    """out [b, s_q, h, 512] (bf16 values) and lse [b, h, s_q] of one model."""
    q = np.asarray(case["q"]).astype(np.float32).astype(np.float64)
    cache = np.asarray(case["kv_cache"])
    keys = np_dequantize_kv(cache).reshape(-1, 576).astype(np.float64)  # the rule's
    codes, scales, rope = np_token_fields(np_cache_to_rows(cache, "V32").reshape(-1, 656), "V32")
    codes, rope = codes.astype(np.float64), rope.astype(np.float64)
    idx = np.asarray(case["indices"])
    c2 = F32(case["sm_scale"]) * F32(np.log2(np.e))
    b, s_q, h, _ = q.shape
    out, lse = np.zeros((b, s_q, h, 512)), np.zeros((b, h, s_q))
    for i in range(b):
        for s in range(s_q):
            qi, sel = q[i, s], idx[i, s]
            if model == "f16":
                part = np.einsum("ntd,htd->nht", codes[sel], _q_f16(qi[:, :512]).reshape(h, *codes.shape[1:]))
                logits = ((part * scales[sel][:, None, :]).sum(-1) + rope[sel] @ qi[:, 512:].T).astype(F32)
                values, p_type = _values_f16(codes[sel], scales[sel]), F16
            else:
                logits, values, p_type = dot_f32(qi, keys[sel], "exact"), keys[sel, :512], BF16
            o, lse2 = decode_pieces((logits * c2).astype(F32), values, p_type)
            out[i, s] = o.astype(BF16)
            lse[i, :, s] = lse2 / np.log2(np.e)
    return out, lse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:25", help="START:STOP")
    args = ap.parse_args(argv)
    seeds = range(*map(int, args.seeds.split(":")))
    ref = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))
    failed = False
    for h_q in (16, 64):
        # per model: out's largest excess over the test's bound, lse's largest |error| / tolerance
        worst = {m: [-np.inf, 0.0] for m in ("rule", "f16")}
        for seed in seeds:
            case = v32_scales_case(np.random.default_rng(seed), h_q)
            ref_out, ref_lse = ref(**case)
            r = np.asarray(ref_out.astype(np.float32)).astype(np.float64)
            rl = np.asarray(ref_lse).astype(np.float64)
            bound = v32_scales_bound(case, r)
            for m in worst:
                a, al = model_decode(case, m)
                excess = np.abs(a - r) - bound
                failed |= bool(np.isnan(excess).any() or (excess > 0).any())
                failed |= bool(out_of_tolerance(al, rl, LSE_ATOL, LSE_RTOL).any())
                used = np.abs(al - rl) / np.maximum(LSE_ATOL, LSE_RTOL * np.abs(rl))
                worst[m][0] = max(worst[m][0], float(np.nanmax(excess)))
                worst[m][1] = max(worst[m][1], float(np.nanmax(used)))
        print(f"h_q {h_q}, seeds {seeds.start}:{seeds.stop}: per model, the largest out excess over the "
              f"test's bound (<= 0 holds) and |lse error| / tolerance (<= 1 holds): {worst}", flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())

"""CPU check of the f16 products' numerics (the V32 few-heads kernel, ffi/cuda/decode_small_rs.cuh;
docs/numerics.md) on tests/test_gpu.py::test_non_power_of_two_v32_scales's inputs, at 16 and 64 heads:
the largest excess of out over the test's bound and of |lse error| over assert_lse_close's
tolerance, for a NumPy model of that kernel's arithmetic and one of the bf16 rule of the other kernels.

    python benchmarks/emulate_f16_products.py --seeds 0:25
    python benchmarks/emulate_f16_products.py --format MODEL1 --seeds 0:60

`--format MODEL1` checks the same kernel's MODEL1 instance on 16-head cases like the GPU shape
tests' instead: its RoPE value dims enter P V in bf16 as stored, with P in bf16 (their own m-tile).

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
from tests.utils.cases import make_case, soften  # noqa: E402
from jax_sparse_mla import KVFormat  # noqa: E402
from tests.utils.np_formats import np_cache_to_rows, np_token_fields  # noqa: E402
from tests.utils.tolerances import LSE_ATOL, LSE_RTOL, OUT_ATOL, OUT_COS_DIFF, OUT_RTOL, out_of_tolerance  # noqa: E402

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
    fmt = "V32" if q.shape[-1] == 576 else "MODEL1"
    d_qk, d_nope = q.shape[-1], 512 if fmt == "V32" else 448
    keys = np_dequantize_kv(cache).reshape(-1, d_qk).astype(np.float64)  # the rule's
    rows = np_cache_to_rows(cache, fmt)
    codes, scales, rope = np_token_fields(rows.reshape(-1, rows.shape[-1]), fmt)
    codes, rope = codes.astype(np.float64), rope.astype(np.float64)
    idx = np.asarray(case["indices"])
    c2 = F32(case.get("sm_scale", q.shape[-1] ** -0.5)) * F32(np.log2(np.e))
    b, s_q, h, _ = q.shape
    out, lse = np.zeros((b, s_q, h, 512)), np.zeros((b, h, s_q))
    for i in range(b):
        for s in range(s_q):
            qi, sel = q[i, s], idx[i, s]
            if model == "f16":
                part = np.einsum("ntd,htd->nht", codes[sel], _q_f16(qi[:, :d_nope]).reshape(h, *codes.shape[1:]))
                logits = ((part * scales[sel][:, None, :]).sum(-1) + rope[sel] @ qi[:, d_nope:].T).astype(F32)
                o, lse2 = decode_pieces((logits * c2).astype(F32), _values_f16(codes[sel], scales[sel]), F16)
                if fmt == "MODEL1":  # the RoPE value dims: bf16 as stored, P in bf16
                    o = np.concatenate([o, decode_pieces((logits * c2).astype(F32), rope[sel], BF16)[0]], axis=-1)
            else:
                logits = dot_f32(qi, keys[sel], "exact")
                o, lse2 = decode_pieces((logits * c2).astype(F32), keys[sel, :512], BF16)
            out[i, s] = o.astype(BF16)
            lse[i, :, s] = lse2 / np.log2(np.e)
    return out, lse


def _model1_case(rng):
    """A MODEL1 16-head case as tests/test_gpu.py's shape tests draw them (softened), every
    entry valid (the models index the cache directly)."""
    case = make_case(rng, KVFormat.MODEL1, b=2, s_q=2, h_q=16, topk=256, page_size=64, num_blocks=16, invalid_fraction=0.0)
    return soften(case)


def _model1_bound(case, ref_out):
    """assert_out_close's elementwise rule: |out - ref| <= atol or <= rtol |ref|."""
    return np.maximum(OUT_ATOL, OUT_RTOL * np.abs(ref_out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:25", help="START:STOP")
    ap.add_argument("--format", default="V32", choices=("V32", "MODEL1"),
                    help="V32: the non-power-of-two scale test at 16 and 64 heads; MODEL1: 16-head "
                         "shape-test cases")
    args = ap.parse_args(argv)
    seeds = range(*map(int, args.seeds.split(":")))
    ref = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))
    failed = False
    if args.format == "V32":
        kinds = [(f"h_q {h_q}", lambda rng, h_q=h_q: v32_scales_case(rng, h_q), v32_scales_bound) for h_q in (16, 64)]
    else:
        kinds = [("MODEL1 h_q 16", _model1_case, _model1_bound)]
    for name, make, bound_of in kinds:
        # per model: out's largest excess over the test's bound, lse's largest |error| / tolerance,
        # and the whole tensor's cosine difference / OUT_COS_DIFF
        worst = {m: [-np.inf, 0.0, 0.0] for m in ("rule", "f16")}
        for seed in seeds:
            case = make(np.random.default_rng(seed))
            ref_out, ref_lse = ref(**case)
            r = np.asarray(ref_out.astype(np.float32)).astype(np.float64)
            rl = np.asarray(ref_lse).astype(np.float64)
            bound = bound_of(case, r)
            for m in worst:
                a, al = model_decode(case, m)
                excess = np.abs(a - r) - bound
                cos = (1.0 - 2.0 * np.sum(a * r) / np.sum(a * a + r * r)) / OUT_COS_DIFF
                failed |= bool(np.isnan(excess).any() or (excess > 0).any() or not cos < 1.0)
                failed |= bool(out_of_tolerance(al, rl, LSE_ATOL, LSE_RTOL).any())
                used = np.abs(al - rl) / np.maximum(LSE_ATOL, LSE_RTOL * np.abs(rl))
                worst[m] = [max(worst[m][0], float(np.nanmax(excess))), max(worst[m][1], float(np.nanmax(used))),
                            max(worst[m][2], float(cos))]
        print(f"{name}, seeds {seeds.start}:{seeds.stop}: per model, the largest out excess over the "
              f"test's bound (<= 0 holds), |lse error| / tolerance and cosine difference / bound "
              f"(< 1 hold): {worst}", flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())

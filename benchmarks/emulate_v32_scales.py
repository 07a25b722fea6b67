"""CPU check of tests/test_gpu.py::test_non_power_of_two_v32_scales's bound: replays the test's
inputs through NumPy models of the CUDA decode's arithmetic and of other fp32 references, and
reports, per model, how often the bf16-only bound (the one before seed=3231109967) fails and the
largest excess over the test's bound (negative: it holds).

    python benchmarks/emulate_v32_scales.py --seeds 0:60 --models exact,k16,tc0,tc3,ref_k16,ref_seq

Kernel models (decode_wgmma.cu + combine.cu): logits S = q.K in fp32, summed as `exact` (exact
sum rounded once: the best any fp32 kernel can do), `k16` (each 16-dim step's exact sum added to
an fp32 accumulator, round to nearest) or `tcN` (tensor-core model of Fasi et al.: per 16-dim
step the products and the accumulator are truncated at the largest addend's ulp with N extra
bits, the sum truncated to fp32); x = S * fl(sm_scale log2 e); per 64-entry block an online max
m, p = exp2(x - m) in fp32, the row sum l from the fp32 p, P rounded to bf16 before P V, fp32
accumulators; one split piece per block (the H200 plan of this shape), each piece's o / l and
fp32 lse log2(l) + m merged as combine.cu does; out rounded to bf16. Reference models
(`ref_k16`, `ref_seq`: 16-dim steps or one dim at a time): reference.py's math in fp32. Each is
compared with the JAX reference run on the CPU, as the test compares with the one on the GPU.
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
from tests.utils import np_dequantize_kv  # noqa: E402

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _rz32(s):
    """float64 -> float32 rounded toward zero."""
    r = s.astype(F32)
    return np.where(np.abs(r.astype(np.float64)) > np.abs(s), np.nextafter(r, F32(0)), r).astype(F32)


def dot_f32(q, keys, model):
    """fp32 q.K^T: q [h, d], keys [n, d] (bf16 values) -> [n, h]."""
    q, keys = q.astype(np.float64), keys.astype(np.float64)
    if model == "exact":
        return (keys @ q.T).astype(F32)
    acc = np.zeros((keys.shape[0], q.shape[0]))
    step = 1 if model == "seq" else 16
    for d0 in range(0, keys.shape[1], step):
        t = keys[:, None, d0:d0 + step] * q[None, :, d0:d0 + step]  # exact products [n, h, step]
        if model.startswith("tc"):
            addends = np.concatenate([t, acc[..., None]], axis=-1)
            top = np.abs(addends).max(axis=-1, keepdims=True)
            ulp = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))) - 23 - int(model[2:]))
            acc = _rz32((np.trunc(addends / ulp) * ulp).sum(axis=-1)).astype(np.float64)
        else:
            acc = (acc + t.sum(axis=-1)).astype(F32).astype(np.float64)
    return acc.astype(F32)


def _piece(x, values, p_type=BF16):
    """One split piece over entries x [n, h] (base-2 logits): (o / l [h, 512], lse2 [h]), fp32;
    P rounded to `p_type` before P V."""
    h = x.shape[1]
    m, l, o = np.full(h, -np.inf, F32), np.zeros(h, F32), np.zeros((h, values.shape[1]), F32)
    for b0 in range(0, x.shape[0], 64):
        xb = x[b0:b0 + 64]
        m_new = np.maximum(m, xb.max(axis=0))
        alpha = np.exp2((m - m_new).astype(np.float64)).astype(F32)
        p = np.exp2((xb - m_new).astype(F32).astype(np.float64)).astype(F32)
        l = (l * alpha + p.astype(np.float64).sum(axis=0)).astype(F32)
        pv = p.astype(p_type).astype(np.float64).T @ values[b0:b0 + 64].astype(np.float64)
        o = (o.astype(np.float64) * alpha[:, None] + pv).astype(F32)
        m = m_new
    return (o * (F32(1) / l)[:, None]).astype(F32), (np.log2(l.astype(np.float64)).astype(F32) + m).astype(F32)


def _combine(pieces):
    """combine.cu's merge of split pieces: (out [h, 512], lse2 [h]), fp32."""
    lse = np.stack([p[1] for p in pieces])
    mx = lse.max(axis=0)
    total = np.exp2((lse - mx).astype(F32).astype(np.float64)).astype(F32).sum(axis=0, dtype=F32)
    g = (np.log2(total.astype(np.float64)).astype(F32) + mx).astype(F32)
    out = np.zeros(pieces[0][0].shape, F32)
    for acc, lk in pieces:
        w = np.exp2((lk - g).astype(F32).astype(np.float64)).astype(F32)
        out = (out + w[:, None] * acc).astype(F32)
    return out, g


def decode_pieces(x, values, p_type=BF16):
    """A row's decode over its entries x [n, h] (base-2 logits), one split piece per 64 entries
    (the H200 plan of the test's shape): (out [h, 512], lse2 [h]) before the bf16 output."""
    pieces = [_piece(x[p0:p0 + 64], values[p0:p0 + 64], p_type) for p0 in range(0, x.shape[0], 64)]
    return _combine(pieces) if len(pieces) > 1 else pieces[0]


def _rows(case):
    q = np.asarray(case["q"]).astype(F32)
    keys = np_dequantize_kv(np.asarray(case["kv_cache"])).reshape(-1, 576).astype(F32)
    idx = np.asarray(case["indices"])
    for i in range(q.shape[0]):
        for s in range(q.shape[1]):
            yield i, s, q[i, s], keys[idx[i, s]]


def kernel_out(case, model):
    c2 = (F32(case["sm_scale"]) * F32(np.log2(np.e))).astype(F32)
    out = np.zeros(case["q"].shape[:3] + (512,))
    for i, s, q, keys in _rows(case):
        x = (dot_f32(q, keys, model) * c2).astype(F32)
        out[i, s] = decode_pieces(x, keys[:, :512])[0].astype(BF16)
    return out


def reference_out(case, model):
    out = np.zeros(case["q"].shape[:3] + (512,))
    for i, s, q, keys in _rows(case):
        z = (dot_f32(q, keys, model) * F32(case["sm_scale"])).astype(F32)
        p = np.exp((z - z.max(axis=0)).astype(np.float64)).astype(F32)
        p = (p / p.sum(axis=0, dtype=F32)).astype(F32)
        out[i, s] = (p.astype(np.float64).T @ keys[:, :512].astype(np.float64)).astype(F32).astype(BF16)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:60", help="START:STOP, or comma-separated seeds")
    ap.add_argument("--models", default="exact,k16,tc0,tc3,ref_k16,ref_seq")
    args = ap.parse_args(argv)
    seeds = (range(*map(int, args.seeds.split(":"))) if ":" in args.seeds
             else [int(v) for v in args.seeds.split(",")])
    models = args.models.split(",")
    ref = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))
    old_fails = dict.fromkeys(models, 0)
    worst = dict.fromkeys(models, -np.inf)
    for seed in seeds:
        case = v32_scales_case(np.random.default_rng(seed))
        r = np.asarray(ref(**case)[0].astype(np.float32)).astype(np.float64)
        old, new = v32_scales_bound(case, r, logit_errors=False), v32_scales_bound(case, r)
        line = []
        for m in models:
            a = reference_out(case, m[4:]) if m.startswith("ref_") else kernel_out(case, m)
            d = np.abs(a - r)
            old_fails[m] += bool(np.any(d > old))
            worst[m] = max(worst[m], float(np.max(d - new)))
            line.append(f"{m} {float(np.max(d - old)):+.3g}/{float(np.max(d - new)):+.3g}")
        print(f"seed {seed}: max excess bf16-only/test bound: " + ", ".join(line), flush=True)
    print(f"{len(seeds)} seeds. bf16-only bound failed: {old_fails}; "
          f"largest excess over the test's bound: {worst}")
    return int(any(v > 0 for v in worst.values()))


if __name__ == "__main__":
    sys.exit(main())

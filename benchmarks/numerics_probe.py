"""Where a kernel's rounding error comes from: the op's output against the float64 definition
and against a NumPy model of the 16-head kernel's arithmetic, request by request.

The model (ffi/cuda/decode_small.cuh, one piece per request): blocks of 64 list entries in
list order; S in fp32; the running maximum with the lazy rescale (kept until a block's maximum
passes it by 8, in base-2 logit units); p = exp2(S * scale_log2 - m) in fp32, summed in fp32;
P rounded to bf16 for P V; O in fp32 (alpha O + P V per block); out = bf16(O / l, times the
sink factor). What it leaves out: the tensor cores' own accumulation order and truncation, and
the order of the fp32 sums.

If the kernel's error against float64 is the model's, the model explains it. If the kernel
minus the model is as large as the model's own error, the kernel rounds somewhere the model
does not: the table says which requests and heads.

    python3 benchmarks/numerics_probe.py --seed 1990244600            # the stale-plan test's case
    python3 benchmarks/numerics_probe.py --seed 7 --heads 64 --parts 3

On a machine without a GPU it runs the CPU handler (which computes in float32 with fp32
probabilities: its error is far below the model's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax_sparse_mla as jsm  # noqa: E402
from tests.utils import cosine_difference as cos_diff  # noqa: E402
from tests.utils import stale_lengths_case  # noqa: E402
from tests.utils.np_formats import BF16, np_dequantize_kv  # noqa: E402
from tests.utils.np_reference import np_sparse_mla_decode, valid_mask  # noqa: E402

BLOCK = 64
LAZY_RESCALE = 8.0
INIT_MAX = np.float32(-1e30)
F32 = np.float32


def bf16(x):
    """Round float32 values to bfloat16 (nearest even) and back to float32."""
    return np.asarray(x, F32).astype(BF16).astype(F32)


def stale_plan_case(seed, fmt, h_q):
    """The case of tests/test_gpu.py::test_stale_plan_gives_nan_never_a_finite_wrong_answer for
    `seed`, with the lengths its call uses."""
    case, _, new, extra = stale_lengths_case(np.random.default_rng(seed), fmt, h_q)
    case["topk_length"] = jnp.asarray(new, jnp.int32)
    if extra is not None:
        case["extra_topk_length"] = jnp.asarray(extra, jnp.int32)
    return case


def _lists(case, d_qk):
    """Per list (main, then extra): (dequantized tokens, indices, valid mask)."""
    out = []
    for cache_key, idx_key, len_key in (("kv_cache", "indices", "topk_length"),
                                        ("extra_kv_cache", "extra_indices", "extra_topk_length")):
        if case.get(cache_key) is None:
            continue
        tokens = np_dequantize_kv(np.asarray(case[cache_key])).reshape(-1, d_qk).astype(np.float64)
        idx = np.asarray(case[idx_key])
        lens = case.get(len_key)
        out.append((tokens, idx, valid_mask(idx, None if lens is None else np.asarray(lens), tokens.shape[0])))
    return out


def model_decode(case, *, rounded_sums=False, lazy_rescale=LAZY_RESCALE):
    """The 16-head kernel's arithmetic in NumPy: out [b, s_q, h_q, 512] (bf16 values as float32).
    `rounded_sums`: the row sums add the bf16 probabilities (benchmarks/patches/l_sums_rounded_p.patch);
    `lazy_rescale=0`: the running maximum is the exact one."""
    q = np.asarray(jnp.asarray(case["q"]).astype(jnp.float32)).astype(np.float64)
    b, s_q, h_q, d_qk = q.shape
    sm_scale = case.get("sm_scale")
    scale_log2 = F32((d_qk ** -0.5 if sm_scale is None else float(sm_scale)) * np.log2(np.e))
    sink = case.get("attn_sink")
    sink = None if sink is None else np.asarray(sink, F32).reshape(-1, h_q)
    lists = _lists(case, d_qk)
    out = np.zeros((b, s_q, h_q, 512), F32)
    for r in range(b):
        for s in range(s_q):
            m = np.full(h_q, INIT_MAX, F32)
            l = np.zeros(h_q, F32)
            o = np.zeros((h_q, 512), F32)
            first = True
            for tokens, idx, ok in lists:
                topk = idx.shape[-1]
                for k0 in range(0, topk, BLOCK):
                    sel = ok[r, s, k0:k0 + BLOCK]
                    if not sel.any():
                        continue  # a block past the length is not walked
                    keys = tokens[np.clip(idx[r, s, k0:k0 + BLOCK], 0, tokens.shape[0] - 1)]
                    keys = np.where(sel[:, None], keys, 0.0)
                    z = (keys @ q[r, s].T).astype(F32)  # [64, h]: exact products, fp32 result
                    z = np.where(sel[:, None], z, F32(-np.inf))
                    mx_scaled = (z.max(axis=0) * scale_log2).astype(F32)
                    grow = mx_scaled > m + F32(lazy_rescale)
                    m_new = np.where(grow, mx_scaled, m)
                    alpha = np.where(grow, np.exp2(m - m_new), F32(1)).astype(F32)
                    m = m_new
                    l = (l * alpha).astype(F32)
                    with np.errstate(invalid="ignore"):
                        p = np.exp2((z.astype(np.float64) * scale_log2 - m).astype(F32)).astype(F32)
                    p = np.where(sel[:, None], p, F32(0))
                    l = (l + (bf16(p) if rounded_sums else p).sum(axis=0, dtype=F32)).astype(F32)
                    if not first:
                        o = (o * alpha[:, None]).astype(F32)
                    pv = bf16(p).astype(np.float64).T @ keys[:, :512]  # exact products
                    o = (o + pv.astype(F32)).astype(F32)
                    first = False
            if first:
                continue  # no valid entry: out stays 0
            f = (F32(1) / l).astype(F32)
            if sink is not None:
                lse_nat = ((np.log2(l) + m) * F32(np.log(2))).astype(F32)
                f = (f * (F32(1) / (F32(1) + np.exp(sink[r % sink.shape[0]] - lse_nat)))).astype(F32)
            out[r, s] = bf16(o * f[:, None])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1990244600, help="the test's seed (default: the failing one of session 10)")
    ap.add_argument("--heads", type=int, default=16, help="h_q (16: the few-heads kernel)")
    ap.add_argument("--format", choices=["V32", "MODEL1"], default="V32")
    ap.add_argument("--parts", type=int, default=1, help="plan workers (1: one piece per request, no combine)")
    ap.add_argument("--rounded-sums", action="store_true",
                    help="model the kernel with benchmarks/patches/l_sums_rounded_p.patch applied")
    args = ap.parse_args(argv)

    fmt = jsm.KVFormat.V32 if args.format == "V32" else jsm.KVFormat.MODEL1
    case = stale_plan_case(args.seed, fmt, args.heads)
    plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case.get("topk_length"),
                           extra_indices=case.get("extra_indices"),
                           extra_topk_length=case.get("extra_topk_length"), num_parts=args.parts)
    out, _ = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))(**case, plan=plan)
    kernel = np.asarray(out.astype(jnp.float32))
    exact, _ = np_sparse_mla_decode(**{k: v if k == "sm_scale" else np.asarray(v) for k, v in case.items()})
    model = model_decode(case, rounded_sums=args.rounded_sums)

    print(f"device {jax.devices()[0].platform}, seed {args.seed}, {args.format}, h_q {args.heads}, "
          f"{args.parts} part(s); cosine difference (x1e-6) against float64, and kernel vs model")
    print(f"{'request':>8} {'kernel':>9} {'model':>9} {'k - m':>9} {'corr':>6}")
    for r in range(kernel.shape[0]):
        ek, em = kernel[r] - exact[r], model[r] - exact[r]
        corr = float(np.corrcoef(ek.ravel(), em.ravel())[0, 1]) if ek.any() and em.any() else float("nan")
        print(f"{r:>8} {cos_diff(kernel[r], exact[r]) * 1e6:9.3f} {cos_diff(model[r], exact[r]) * 1e6:9.3f} "
              f"{cos_diff(kernel[r], model[r]) * 1e6:9.3f} {corr:6.2f}")
    print(f"{'all':>8} {cos_diff(kernel, exact) * 1e6:9.3f} {cos_diff(model, exact) * 1e6:9.3f} "
          f"{cos_diff(kernel, model) * 1e6:9.3f}")
    worst = int(np.argmax([cos_diff(kernel[r], exact[r]) for r in range(kernel.shape[0])]))
    print(f"request {worst} by (query row, head): kernel / model cosine difference x1e-6")
    for s in range(kernel.shape[1]):
        cells = [f"{cos_diff(kernel[worst, s, h], exact[worst, s, h]) * 1e6:.1f}/"
                 f"{cos_diff(model[worst, s, h], exact[worst, s, h]) * 1e6:.1f}" for h in range(kernel.shape[2])]
        print(f"  s={s}: " + " ".join(cells))


if __name__ == "__main__":
    main()

"""Where a kernel's rounding error comes from: the op's output against the float64 definition
and against a NumPy model of the 16-head kernel's arithmetic, request by request.

The model (the bf16 rule of the 64-row kernel and of the retired bf16-tile few-heads kernel of
sessions 6-22, the plan's pieces merged as the combine does): blocks of
64 list entries in list order; S in fp32; the running maximum with the lazy rescale (kept until a block's maximum
passes it by 8, in base-2 logit units); p = exp2(S * scale_log2 - m) in fp32, summed in fp32;
P rounded to bf16 for P V; O in fp32 (alpha O + P V per block); out = bf16(O / l, times the
sink factor). What it leaves out: the tensor cores' own accumulation order and truncation, and
the order of the fp32 sums.

If the kernel's error against float64 is the model's, the model explains it. If the kernel
minus the model is as large as the model's own error, the kernel rounds somewhere the model
does not: the table says which requests and heads.

    python3 benchmarks/numerics_probe.py --seed 1990244600            # the stale-plan test's case
    python3 benchmarks/numerics_probe.py --seed 7 --heads 64 --parts 3
    python3 benchmarks/numerics_probe.py --sweep 1500 --format MODEL1   # the test on the model, CPU

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
from tests.utils import assert_out_agree, assert_out_close  # noqa: E402
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


def _request_blocks(lists, r, s, lens):
    """Request r's blocks in the kernel's order (main list, then extra): (tokens, indices, valid)
    per block of 64 entries; `lens` = (main length, extra length) of the call, clamped."""
    blocks = []
    for li, (tokens, idx, ok) in enumerate(lists):
        n = max(-(-lens[li] // BLOCK), 1) if li == 0 else -(-lens[li] // BLOCK)
        blocks += [(tokens, idx[r, s, k0:k0 + BLOCK], ok[r, s, k0:k0 + BLOCK]) for k0 in range(0, n * BLOCK, BLOCK)]
    return blocks


def _piece(blocks, q_rs, scale_log2, h_q, rounded_sums, lazy_rescale):
    """One piece's online softmax over `blocks`: (O unnormalized, m, l), float32."""
    m = np.full(h_q, INIT_MAX, F32)
    l = np.zeros(h_q, F32)
    o = np.zeros((h_q, 512), F32)
    first = True
    for tokens, idx, sel in blocks:
        if not sel.any():
            continue  # every entry masked: p = 0, m and l unchanged
        keys = tokens[np.clip(idx, 0, tokens.shape[0] - 1)]
        keys = np.where(sel[:, None], keys, 0.0)
        z = (keys @ q_rs.T).astype(F32)  # [64, h]: exact products, fp32 result
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
    return o, m, l


def _pieces_of(sched, r, n_blocks):
    """Block ranges [begin, end) of request r's pieces under a plan's `sched`, in slot order."""
    ranges = []
    for row in sched:
        begin_req, end_req, begin_block, end_block = (int(v) for v in row[:4])
        if begin_req <= r <= end_req:
            ranges.append((begin_block if r == begin_req else 0, end_block if r == end_req else n_blocks))
    return ranges


def model_decode(case, *, plan=None, rounded_sums=False, lazy_rescale=LAZY_RESCALE):
    """The 16-head kernel's arithmetic in NumPy: out [b, s_q, h_q, 512] (bf16 values as float32).
    `plan`: a DecodePlan whose pieces the model follows (None: one piece a request); its block
    ranges are taken as they are, stale or not, and a request whose pieces do not cover its
    blocks exactly comes out NaN, as the kernel's checks make it.
    `rounded_sums`: the row sums add the bf16 probabilities (the l_sums_rounded_p patch, in git at bcd3da4);
    `lazy_rescale=0`: the running maximum is the exact one."""
    q = np.asarray(jnp.asarray(case["q"]).astype(jnp.float32)).astype(np.float64)
    b, s_q, h_q, d_qk = q.shape
    sm_scale = case.get("sm_scale")
    scale_log2 = F32((d_qk ** -0.5 if sm_scale is None else float(sm_scale)) * np.log2(np.e))
    sink = case.get("attn_sink")
    sink = None if sink is None else np.asarray(sink, F32).reshape(-1, h_q)
    lists = _lists(case, d_qk)
    sizes = [idx.shape[-1] for _, idx, _ in lists]
    lens = []
    for key, size in zip(("topk_length", "extra_topk_length"), sizes):
        v = case.get(key)
        lens.append(np.clip(np.full(b, size) if v is None else np.asarray(v), 0, size))
    sched = None if plan is None else np.asarray(plan.sched)
    out = np.zeros((b, s_q, h_q, 512), F32)
    for r in range(b):
        for s in range(s_q):
            blocks = _request_blocks(lists, r, s, [int(x[r]) for x in lens])
            ranges = [(0, len(blocks))] if sched is None else _pieces_of(sched, r, len(blocks))
            if (ranges[-1][1] != len(blocks) or any(a[1] != c[0] for a, c in zip(ranges, ranges[1:]))
                    or any(a >= e for a, e in ranges)):
                out[r, s] = np.nan  # the plan's pieces do not cover this call's blocks
                continue
            parts = [_piece(blocks[a:e], q[r, s], scale_log2, h_q, rounded_sums, lazy_rescale) for a, e in ranges]
            if len(parts) == 1:
                o, m, l = parts[0]
                empty = l == 0
                f = np.where(empty, F32(0), F32(1) / np.where(empty, F32(1), l)).astype(F32)
                with np.errstate(divide="ignore"):
                    lse_nat = ((np.log2(l) + m) * F32(np.log(2))).astype(F32)
                o_n = o
            else:  # pieces normalized and merged as the combine does (docs/schedule.md), float32
                lse2 = []
                o_k = []
                for o, m, l in parts:
                    empty = l == 0
                    o_k.append((o * np.where(empty, F32(0), F32(1) / np.where(empty, F32(1), l))[:, None]).astype(F32))
                    with np.errstate(divide="ignore"):
                        lse2.append(np.where(empty, F32(-np.inf), (np.log2(l) + m).astype(F32)))
                lse2 = np.stack(lse2)
                mx = lse2.max(axis=0)
                g = (np.log2(np.exp2(lse2 - mx).sum(axis=0, dtype=F32)) + mx).astype(F32)
                o_n = sum((np.exp2(lk - g)[:, None] * ok).astype(F32) for lk, ok in zip(lse2, o_k)).astype(F32)
                f = np.ones(h_q, F32)
                empty = ~np.isfinite(mx)
                lse_nat = (g * F32(np.log(2))).astype(F32)
                o_n = np.where(empty[:, None], F32(0), o_n)
            if sink is not None:
                # (an overflow gives sf = 0, the limit; an empty row -inf - -inf, discarded below)
                with np.errstate(over="ignore", invalid="ignore"):
                    sf = F32(1) / (F32(1) + np.exp(sink[r % sink.shape[0]] - lse_nat))
                f = np.where(empty, f, (f * sf).astype(F32))
            out[r, s] = bf16(o_n * f[:, None])
    return out


def _plan_for(case, lengths, extra, parts):
    return jsm.plan_decode(case["q"], case["indices"], topk_length=jnp.asarray(lengths, jnp.int32),
                           extra_indices=case.get("extra_indices"),
                           extra_topk_length=None if extra is None else jnp.asarray(extra, jnp.int32),
                           num_parts=parts)


def stale_plan_in_the_model(seed, fmt, h_q, parts, rounded_sums=False):
    """tests/test_gpu.py's stale-plan test run on the model instead of the kernel, for `seed`:
    returns (the requests the stale plan still covers, the largest cosine difference between
    such a request's output on the stale plan and on a fresh one, the covered requests' cosine
    difference against float64, the assertions that fail: [(rule, message)] with rule "spec"
    (the two plans' outputs held to the reference's tolerance), "agree" (to the bound that
    implies, the test's rule) or "reference")."""
    case, old, new, extra = stale_lengths_case(np.random.default_rng(seed), fmt, h_q)
    call = dict(case, topk_length=jnp.asarray(new, jnp.int32))
    if extra is not None:
        call["extra_topk_length"] = jnp.asarray(extra, jnp.int32)
    exact, _ = np_sparse_mla_decode(**{k: v if k == "sm_scale" else np.asarray(v) for k, v in call.items()})
    stale = model_decode(call, plan=_plan_for(case, old, extra, parts), rounded_sums=rounded_sums)
    fresh = model_decode(call, plan=_plan_for(case, new, extra, parts), rounded_sums=rounded_sums)
    covered = [r for r in range(stale.shape[0]) if not np.isnan(stale[r]).any()]
    failures = []
    for rule, check in (("spec", assert_out_close), ("agree", assert_out_agree)):
        for r in covered:
            try:
                check(stale[r], fresh[r])
            except AssertionError as e:
                failures.append((rule, f"request {r}: {e}"))
    if covered:
        try:
            assert_out_close(stale[covered], exact[covered])
        except AssertionError as e:
            failures.append(("reference", str(e)))
    pair = max((cos_diff(stale[r], fresh[r]) for r in covered), default=0.0)
    ref = cos_diff(stale[covered], exact[covered]) if covered else 0.0
    return covered, pair, ref, failures


def sweep(seeds, fmt, h_q, parts_list, rounded_sums):
    """The stale-plan test in the model over seeds 0 .. seeds - 1 and each worker count: the
    distribution of its cosine differences and the seeds whose assertions fail."""
    progress = None
    try:
        from rich.progress import Progress

        progress = Progress(transient=True)
        task = progress.add_task(f"{fmt.name} h{h_q} seeds", total=seeds * len(parts_list))
        progress.start()
    except ImportError:
        pass
    pairs, refs, failed = [], [], []
    try:
        for seed in range(seeds):
            for parts in parts_list:
                _, pair, ref, failures = stale_plan_in_the_model(seed, fmt, h_q, parts, rounded_sums)
                pairs.append(pair)
                refs.append(ref)
                failed += [(seed, parts, rule, msg) for rule, msg in failures]
                if progress is not None:
                    progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
    print(f"{fmt.name} h_q {h_q}, {seeds} seeds x parts {parts_list}, "
          f"{'rounded' if rounded_sums else 'unrounded'} row sums; cosine difference x1e-6, p50 / p99 / p99.9 / max:")
    for name, v in (("stale vs fresh plan, worst request", pairs), ("covered requests vs float64", refs)):
        q = np.percentile(np.asarray(v) * 1e6, [50, 99, 99.9, 100])
        print(f"  {name:<36} " + " / ".join(f"{x:.2f}" for x in q))
    for rule in ("spec", "agree", "reference"):
        hits = [f for f in failed if f[2] == rule]
        print(f"  fails under rule '{rule}': {len(hits)}" + "".join(f"\n    seed {a} parts {b}: {m}" for a, b, _, m in hits[:10]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1990244600, help="the test's seed (default: the failing one of session 10)")
    ap.add_argument("--heads", type=int, default=16, help="h_q (16: the few-heads kernel)")
    ap.add_argument("--format", choices=["V32", "MODEL1"], default="V32")
    ap.add_argument("--parts", type=int, default=1, help="plan workers (1: one piece per request, no combine)")
    ap.add_argument("--rounded-sums", action="store_true",
                    help="model the kernel with the l_sums_rounded_p patch (in git at bcd3da4) applied")
    ap.add_argument("--sweep", type=int, metavar="N", default=0,
                    help="no kernel: the stale-plan test's assertions on the model for seeds 0 .. N-1, "
                         "parts 3, 11 and 40 (CPU; ~1.5 s a seed)")
    args = ap.parse_args(argv)

    fmt = jsm.KVFormat.V32 if args.format == "V32" else jsm.KVFormat.MODEL1
    if args.sweep:
        sweep(args.sweep, fmt, args.heads, (3, 11, 40), args.rounded_sums)
        return
    case = stale_plan_case(args.seed, fmt, args.heads)
    plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case.get("topk_length"),
                           extra_indices=case.get("extra_indices"),
                           extra_topk_length=case.get("extra_topk_length"), num_parts=args.parts)
    out, _ = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))(**case, plan=plan)
    kernel = np.asarray(out.astype(jnp.float32))
    exact, _ = np_sparse_mla_decode(**{k: v if k == "sm_scale" else np.asarray(v) for k, v in case.items()})
    model = model_decode(case, plan=plan, rounded_sums=args.rounded_sums)

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

"""Quick GPU sanity table: a handful of cases against the reference, one line each, with
where the errors are when a case fails. Used at the start of a device run (before pytest)
so that a broken kernel is diagnosed from one run's output.

    python benchmarks/gpu_smoke.py [--sanitize] [--only V32|MODEL1]
      (--sanitize: tiny garbage-index and garbage-plan cases only; --only: one cache format)
"""

import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax_sparse_mla as jsm  # noqa: E402
from jax_sparse_mla import reference  # noqa: E402
from tests.utils import (  # noqa: E402
    LSE_ATOL,
    LSE_RTOL,
    OUT_ATOL,
    OUT_RTOL,
    conformance_files,
    load_conformance,
    make_case,
    out_of_tolerance,
)
from tests.utils import soften  # noqa: E402  (FlashMLA-like |V|; see the note there)

V32, MODEL1 = jsm.KVFormat.V32, jsm.KVFormat.MODEL1
_decode = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))
_reference = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))


def _bad(a, r, atol, rtol):
    """Tolerance failures (mask; docs/numerics.md) and the largest finite |diff|, for the table."""
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    with np.errstate(invalid="ignore"):
        d = np.abs(a - r)
    fin = np.isfinite(d)
    return out_of_tolerance(a, r, atol, rtol), (float(d[fin].max()) if fin.any() else 0.0)


def report(name, case, plan=None):
    case = soften(case)
    try:
        out, lse = _decode(**case, plan=plan)
        ref_out, ref_lse = _reference(**case)
        o = np.asarray(out.astype(jnp.float32))
        ro = np.asarray(ref_out.astype(jnp.float32))
        bad_o, dmax_o = _bad(o, ro, OUT_ATOL, OUT_RTOL)
        bad_l, dmax_l = _bad(np.asarray(lse), np.asarray(ref_lse), LSE_ATOL, LSE_RTOL)
        status = "ok  " if not bad_o.any() and not bad_l.any() else "FAIL"
        line = (f"{status} {name:44s} out bad {int(bad_o.sum()):7d}/{o.size:<8d} max|d| {dmax_o:.3g}  "
                f"lse bad {int(bad_l.sum()):5d}/{bad_l.size:<6d} max|d| {dmax_l:.3g}  nan {int(np.isnan(o).sum())}")
        print(line, flush=True)
        if status == "FAIL":
            b_, s_, h_, d_ = np.nonzero(bad_o) if bad_o.any() else (np.array([]),) * 4
            if bad_o.any():
                print(f"     out bad at b {np.unique(b_)[:8]} s {np.unique(s_)[:8]} h {np.unique(h_)[:16]} "
                      f"d {np.unique(d_)[:16]} (n d {np.unique(d_).size})", flush=True)
                k = tuple(int(x[0]) for x in (b_, s_, h_, d_))
                print(f"     e.g. at {k}: got {o[k]} want {ro[k]}", flush=True)
            if bad_l.any():
                bl, hl, sl = np.nonzero(bad_l)
                k = (int(bl[0]), int(hl[0]), int(sl[0]))
                print(f"     lse bad at b {np.unique(bl)[:8]} h {np.unique(hl)[:16]} s {np.unique(sl)[:8]}; "
                      f"e.g. {k}: got {np.asarray(lse)[k]} want {np.asarray(ref_lse)[k]}", flush=True)
        return status == "ok  "
    except Exception:
        print(f"EXC  {name}\n{traceback.format_exc()[-3000:]}", flush=True)
        return False


def garbage_plan_runs(name, case, rng):
    """A hand-made plan with random values must not read or write out of bounds (memcheck)."""
    try:
        case = soften(case)
        plan = _plan(case, 7)
        junk = lambda a: jnp.asarray(rng.integers(-(2**31), 2**31 - 1, size=a.shape, dtype=np.int64).astype(np.int32))
        small = lambda a: jnp.asarray(rng.integers(-2, 9, size=a.shape).astype(np.int32))
        for make in (junk, small):
            bad = jsm.DecodePlan(sched=make(plan.sched), num_splits=make(plan.num_splits), batch=plan.batch,
                                 topk=plan.topk, extra_topk=plan.extra_topk)
            try:
                jax.block_until_ready(_decode(**case, plan=bad))
            except jax.errors.JaxRuntimeError as e:  # the CPU handler refuses such plans: also fine
                if "jax_sparse_mla: plan" not in str(e):
                    raise
        print(f"ok   {name}", flush=True)
        return True
    except Exception:
        print(f"EXC  {name}\n{traceback.format_exc()[-3000:]}", flush=True)
        return False


def _plan(case, parts):
    return jsm.plan_decode(case["q"], case["indices"], topk_length=case.get("topk_length"),
                           extra_indices=case.get("extra_indices"),
                           extra_topk_length=case.get("extra_topk_length"), num_parts=parts)


def main():
    sanitize = "--sanitize" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    formats = [f for f in (V32, MODEL1) if only in (None, f.name)]
    rng = np.random.default_rng(1234)
    print("devices:", jax.devices(), "build:", jsm.build_info(), flush=True)
    cases = []
    if sanitize:
        for fmt in formats:
            c = make_case(rng, fmt, b=3, s_q=2, h_q=16, topk=70, page_size=61, num_blocks=3, extra_topk=40,
                          extra_page_size=5, extra_num_blocks=9, with_lengths=True, with_sink=True,
                          invalid_fraction=0.4, empty_row=True)
            cases.append((f"sanitize {fmt.name} default plan", c, None))
            cases.append((f"sanitize {fmt.name} 7 parts", c, 7))
    else:
        cases += [
            ("V32 h64 s1 b1 k64", make_case(rng, V32, b=1, s_q=1, h_q=64, topk=64, page_size=64, num_blocks=4,
                                            invalid_fraction=0.0, sm_scale=None), None),
            ("V32 h64 s1 b1 k64 garbage", make_case(rng, V32, b=1, s_q=1, h_q=64, topk=64, page_size=64,
                                                    num_blocks=4, sm_scale=None), None),
            ("V32 h128 s2 b3 k300 sink len", make_case(rng, V32, b=3, s_q=2, h_q=128, topk=300, page_size=64,
                                                       num_blocks=16, with_lengths=True, with_sink=True), None),
            ("MODEL1 h64 s2 b2 k128", make_case(rng, MODEL1, b=2, s_q=2, h_q=64, topk=128, page_size=64,
                                                num_blocks=8), None),
            ("MODEL1 h64 s3 b3 k100 ps61 extra ps17", make_case(
                rng, MODEL1, b=3, s_q=3, h_q=64, topk=100, page_size=61, num_blocks=6, extra_topk=90,
                extra_page_size=17, extra_num_blocks=12, with_lengths=True, with_sink=True), None),
            ("V32 h16 s2 b2 k200", make_case(rng, V32, b=2, s_q=2, h_q=16, topk=200, page_size=1, num_blocks=600),
             None),
        ]
        c = make_case(rng, V32, b=3, s_q=2, h_q=64, topk=300, page_size=64, num_blocks=16, with_lengths=True,
                      with_sink=True)
        cases.append(("V32 h64 many splits (17 parts)", c, 17))
        c = make_case(rng, MODEL1, b=3, s_q=2, h_q=128, topk=300, page_size=64, num_blocks=16, extra_topk=70,
                      extra_page_size=64, extra_num_blocks=4, with_lengths=True, with_sink=True)
        cases.append(("MODEL1 h128 many splits (64 parts)", c, 64))
        # Plans that cut no request (33 parts, each two or three whole requests): the pair
        # kernel's walk over whole requests, down to one-block requests.
        c = make_case(rng, V32, b=66, s_q=2, h_q=128, topk=128, page_size=64, num_blocks=16, with_sink=True)
        cases.append(("V32 h128 s2 b66 k128 whole requests (33 parts)", c, 33))
        c = make_case(rng, V32, b=99, s_q=2, h_q=128, topk=64, page_size=64, num_blocks=16)
        cases.append(("V32 h128 s2 b99 k64 one-block requests (33 parts)", c, 33))
        c = make_case(rng, MODEL1, b=66, s_q=2, h_q=128, topk=128, page_size=64, num_blocks=16, extra_topk=64,
                      extra_page_size=64, extra_num_blocks=4)
        cases.append(("MODEL1 h128 s2 b66 k128 x64 whole requests (33 parts)", c, 33))
    ok = 0
    for name, c, parts in cases:
        ok += report(name, c, None if parts is None else _plan(c, parts))
    if sanitize:
        for fmt in formats:
            c = make_case(rng, fmt, b=3, s_q=2, h_q=128, topk=70, page_size=61, num_blocks=3, extra_topk=40,
                          extra_page_size=5, extra_num_blocks=9, with_lengths=True)
            ok += garbage_plan_runs(f"sanitize {fmt.name} garbage plans", c, rng)
            cases.append(None)
    if not sanitize:
        for path in conformance_files():
            v = load_conformance(path)
            kw = dict(q=v["q"], kv_cache=v["kv"], indices=v["indices"], sm_scale=v["sm_scale"])
            for k in ("topk_length", "attn_sink", "extra_topk_length"):
                if v[k] is not None:
                    kw[k] = v[k]
            if v["extra_kv"] is not None:
                kw.update(extra_kv_cache=v["extra_kv"], extra_indices=v["extra_indices"])
            try:
                out, lse = _decode(**kw)
                o = np.asarray(out.astype(jnp.float32))
                bad_o, dmax_o = _bad(o, np.asarray(v["out"].astype(jnp.float32)), OUT_ATOL, OUT_RTOL)
                bad_l, dmax_l = _bad(np.asarray(lse), np.asarray(v["lse"]), LSE_ATOL, LSE_RTOL)
                st = "ok  " if not bad_o.any() and not bad_l.any() else "FAIL"
                print(f"{st} conformance {v['name']:36s} out bad {int(bad_o.sum())} max|d| {dmax_o:.3g}  "
                      f"lse bad {int(bad_l.sum())} max|d| {dmax_l:.3g}", flush=True)
                ok += st == "ok  "
                cases.append(None)
            except Exception:
                print(f"EXC  conformance {v['name']}\n{traceback.format_exc()[-2000:]}", flush=True)
                cases.append(None)
    print(f"SMOKE {ok}/{len(cases)} ok", flush=True)


if __name__ == "__main__":
    main()

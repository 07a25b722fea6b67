"""The FFI decode pipeline (plan, split-KV decode, combine) against the reference,
on fresh random inputs and on FlashMLA's own outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import reference
from tests.utils import (
    fresh_rng,
    assert_lse_close,
    assert_lse_shifted,
    assert_out_close,
    conformance_files,
    conformance_kwargs,
    load_conformance,
    make_case,
    request_blocks,
)

V32, MODEL1 = jsm.KVFormat.V32, jsm.KVFormat.MODEL1
_decode = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))
_reference = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))


def _check(case, plan=None):
    out, lse = _decode(**case, plan=plan)
    ref_out, ref_lse = _reference(**case)
    assert out.shape == ref_out.shape and out.dtype == jnp.bfloat16
    assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32
    assert_out_close(np.asarray(out.astype(jnp.float32)), np.asarray(ref_out.astype(jnp.float32)))
    assert_lse_close(np.asarray(lse), np.asarray(ref_lse))
    return out, lse


@pytest.mark.parametrize("path", conformance_files(), ids=lambda p: p.stem)
def test_conformance(path):
    v = load_conformance(path)
    out, lse = _decode(**conformance_kwargs(v))
    assert_out_close(np.asarray(out.astype(jnp.float32)), np.asarray(v["out"].astype(jnp.float32)))
    assert_lse_close(np.asarray(lse), np.asarray(v["lse"]))


@pytest.mark.parametrize("fmt", [V32, MODEL1])
@pytest.mark.parametrize("h_q", [1, 16, 64, 128])
def test_heads(request, fmt, h_q):
    case = make_case(fresh_rng(), fmt, b=2, s_q=2, h_q=h_q, topk=70, page_size=64, num_blocks=8)
    _check(case)


@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
def test_query_rows(request, s_q):
    case = make_case(fresh_rng(), MODEL1, b=3, s_q=s_q, h_q=16, topk=33, page_size=61, num_blocks=5,
                     with_lengths=True)
    _check(case)


@pytest.mark.parametrize("fmt", [V32, MODEL1])
@pytest.mark.parametrize("page_size", [1, 2, 61, 64, 576])
def test_page_sizes(request, fmt, page_size):
    num_blocks = max(2, 600 // page_size)
    case = make_case(fresh_rng(), fmt, b=2, s_q=1, h_q=16, topk=100, page_size=page_size, num_blocks=num_blocks)
    _check(case)


@pytest.mark.parametrize("topk", [1, 7, 63, 65, 129, 200])
def test_topk_not_multiple_of_64(request, topk):
    case = make_case(fresh_rng(), V32, b=2, s_q=2, h_q=16, topk=topk, page_size=64, num_blocks=6,
                     with_lengths=True, with_sink=True)
    _check(case)


@pytest.mark.parametrize("fmt", [V32, MODEL1])
def test_lengths_zero_and_full(request, fmt):
    case = make_case(fresh_rng(), fmt, b=4, s_q=2, h_q=16, topk=90, page_size=32, num_blocks=8)
    case["topk_length"] = jnp.array([0, 90, 1000, -5], jnp.int32)  # zero, full, clamped high, clamped low
    out, lse = _check(case)
    assert np.all(np.isinf(np.asarray(lse)[[0, 3]]))
    assert np.all(np.asarray(out.astype(jnp.float32))[[0, 3]] == 0)


@pytest.mark.parametrize("fmt", [V32, MODEL1])
def test_extra_cache(request, fmt):
    case = make_case(fresh_rng(), fmt, b=3, s_q=2, h_q=64, topk=50, page_size=64, num_blocks=4,
                     extra_topk=150, extra_page_size=17, extra_num_blocks=20, with_lengths=True, with_sink=True)
    _check(case)


def test_sinks_with_infinities(request):
    case = make_case(fresh_rng(), MODEL1, b=2, s_q=1, h_q=16, topk=64, page_size=64, num_blocks=4)
    sink = np.random.default_rng(0).normal(size=16).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    case["attn_sink"] = jnp.asarray(sink)
    out, _ = _check(case)
    assert np.all(np.asarray(out.astype(jnp.float32))[:, :, 0] == 0)


def test_empty_rows_and_garbage_indices(request):
    rng = fresh_rng()
    case = make_case(rng, V32, b=3, s_q=2, h_q=16, topk=80, page_size=64, num_blocks=4)
    n_tokens = 4 * 64
    bad = np.array([-1, -2**31, n_tokens, n_tokens + 7, 2**31 - 1], np.int32)
    idx = np.asarray(case["indices"]).copy()
    idx[0] = rng.choice(bad, size=idx[0].shape)  # request 0: nothing valid at all
    idx[1, 0] = rng.choice(bad, size=idx[1, 0].shape)  # one empty query row
    case["indices"] = jnp.asarray(idx)
    out, lse = _check(case)
    assert np.all(np.isposinf(np.asarray(lse)[0])) and np.all(np.isposinf(np.asarray(lse)[1, :, 0]))
    assert np.all(np.asarray(out.astype(jnp.float32))[0] == 0)


def test_duplicates_count_twice(request):
    case = make_case(fresh_rng(), V32, b=1, s_q=1, h_q=16, topk=4, page_size=64, num_blocks=2, nan_fill=False)
    case["indices"] = jnp.array([[[5, 5, 9, 9]]], jnp.int32)
    _, lse_dup = _check(case)
    case["indices"] = jnp.array([[[5, 9, -1, -1]]], jnp.int32)
    _, lse_single = _check(case)
    assert_lse_shifted(lse_dup, lse_single, np.log(2.0))


@pytest.mark.parametrize("num_parts", [1, 3, 17, 64])
@pytest.mark.parametrize("fmt", [V32, MODEL1])
def test_many_splits(request, fmt, num_parts):
    """Plans that cut requests into many pieces exercise the combine pass."""
    case = make_case(fresh_rng(), fmt, b=3, s_q=2, h_q=16, topk=300, page_size=64, num_blocks=16,
                     extra_topk=70 if fmt == MODEL1 else 0, extra_page_size=64, extra_num_blocks=4,
                     with_lengths=True, with_sink=True)
    plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case.get("topk_length"),
                           extra_indices=case.get("extra_indices"), extra_topk_length=case.get("extra_topk_length"),
                           num_parts=num_parts)
    splits = np.diff(np.asarray(plan.num_splits))
    if num_parts >= 17:
        assert splits.max() > 1, "expected some request to be split"
    _check(case, plan=plan)


def test_unsplit_is_the_plans_own_answer():
    """plan.unsplit (known while tracing, without length arrays) says whether the plan cuts no
    request, exactly: against its num_splits over a grid of batches, lists and worker counts,
    default and batch-invariant plans too; a plan with length arrays never claims it."""
    seen = set()
    for b in (1, 2, 3, 7, 64, 129):
        for topk, extra_topk in ((1, 0), (64, 0), (65, 0), (128, 512), (300, 70), (2048, 0)):
            q = jax.ShapeDtypeStruct((b, 2, 16, 576), jnp.bfloat16)
            idx = jax.ShapeDtypeStruct((b, 2, topk), jnp.int32)
            eidx = jax.ShapeDtypeStruct((b, 2, extra_topk), jnp.int32) if extra_topk else None
            plans = [jsm.plan_decode(q, idx, extra_indices=eidx, num_parts=n) for n in (1, 2, 3, 4, 7, 33, 66)]
            plans += [jsm.plan_decode(q, idx, extra_indices=eidx), jsm.plan_decode(q, idx, extra_indices=eidx,
                                                                                   batch_invariant=True)]
            for plan in plans:
                one_piece_each = bool(np.all(np.diff(np.asarray(plan.num_splits)) == 1))
                assert plan.unsplit == one_piece_each, (b, topk, extra_topk, plan.num_parts, plan.batch_invariant)
                seen.add(plan.unsplit)
            lens = jnp.full((b,), topk, jnp.int32)
            assert not jsm.plan_decode(q, idx, topk_length=lens, extra_indices=eidx, num_parts=1).unsplit
    assert seen == {True, False}


@pytest.mark.parametrize("fmt", [V32, MODEL1])
def test_unsplit_plans_skip_the_combine(fmt):
    """Without length arrays, a call whose plan cuts no request leaves the combine out of the
    program (the decode writes every row) and one that cuts some keeps it; passed plans and
    plans made inside the call both match the reference."""
    case = make_case(fresh_rng(), fmt, b=3, s_q=2, h_q=16, topk=300, page_size=64, num_blocks=16,
                     extra_topk=70 if fmt == MODEL1 else 0, extra_page_size=64, extra_num_blocks=4, with_sink=True)
    for num_parts, unsplit in ((1, True), (17, False)):
        plan = jsm.plan_decode(case["q"], case["indices"], extra_indices=case.get("extra_indices"),
                               num_parts=num_parts)
        assert plan.unsplit == unsplit
        hlo = _decode.lower(**case, plan=plan).as_text()
        assert ("jsm_combine" in hlo) != unsplit
        _check(case, plan=plan)
    default = jsm.plan_decode(case["q"], case["indices"], extra_indices=case.get("extra_indices"))
    hlo = _decode.lower(**case).as_text()
    assert ("jsm_combine" in hlo) != default.unsplit
    _check(case)


def test_plan_reused_across_calls(request):
    rng = fresh_rng()
    case = make_case(rng, V32, b=2, s_q=2, h_q=16, topk=128, page_size=64, num_blocks=8, with_lengths=True)
    plan = jax.jit(lambda q, i, l: jsm.plan_decode(q, i, topk_length=l, num_parts=9))(
        case["q"], case["indices"], case["topk_length"])
    _check(case, plan=plan)
    case2 = make_case(rng, V32, b=2, s_q=2, h_q=16, topk=128, page_size=64, num_blocks=8)
    case2["topk_length"] = case["topk_length"]
    _check(case2, plan=plan)


def test_few_requests_spread_over_every_worker():
    """Fewer requests than workers: the budget is the smallest that covers every block, down to
    2-block pieces, so 16 requests of 32 blocks over 33 workers go in 16-block pieces (the old
    budget: 18), two in 2-block pieces on 32 workers (old: 3), one stays in 2-block pieces (one-
    block pieces were slower), a budget already below 2 blocks is kept (66 workers), and the
    largest worker's cost never exceeds the old budget's, ceil(total / num_parts) + 5."""
    for b, topk, parts, piece_blocks in ((16, 2048, 33, 16), (2, 2048, 33, 2), (1, 2048, 33, 2), (1, 2048, 66, 1),
                                         (3, 640, 33, 2)):
        q = jax.ShapeDtypeStruct((b, 2, 128, 576), jnp.bfloat16)
        idx = jax.ShapeDtypeStruct((b, 2, topk), jnp.int32)
        plan = jsm.plan_decode(q, idx, num_parts=parts)
        sched = np.asarray(plan.sched)
        pieces = [int(r[3] - r[2]) for r in sched if r[0] == r[1]]
        assert max(pieces) == piece_blocks, (b, topk, parts, pieces)
    rng = fresh_rng()
    for _ in range(30):
        parts = int(rng.integers(2, 140))
        b = int(rng.integers(1, parts))
        topk = int(rng.integers(1, 3000))
        lens = rng.integers(0, topk + 1, size=b).astype(np.int32)
        q = jax.ShapeDtypeStruct((b, 1, 16, 576), jnp.bfloat16)
        idx = jax.ShapeDtypeStruct((b, 1, topk), jnp.int32)
        plan = jsm.plan_decode(q, idx, topk_length=jnp.asarray(lens), num_parts=parts)
        blocks = request_blocks(lens, topk, None, 0)
        old_budget = -(-int(np.sum(blocks + 5)) // parts) + 5
        sched = np.asarray(plan.sched)
        for br, er, bb, eb in sched[:, :4]:
            cost = sum((eb if r == er else blocks[r]) - (bb if r == br else 0) + 5 for r in range(br, er + 1))
            assert cost <= old_budget, (b, topk, parts, cost, old_budget)


def test_plan_covers_every_block():
    """Every block of every request is done exactly once, pieces numbered in order."""
    rng = fresh_rng()
    for _ in range(20):
        b = int(rng.integers(1, 40))
        topk = int(rng.integers(1, 700))
        extra_topk = int(rng.integers(0, 300))
        num_parts = int(rng.integers(1, 140))
        lens = rng.integers(-3, topk + 5, size=b).astype(np.int32)
        elens = rng.integers(0, extra_topk + 3, size=b).astype(np.int32)
        q = jax.ShapeDtypeStruct((b, 1, 16, 576), jnp.bfloat16)
        idx = jax.ShapeDtypeStruct((b, 1, topk), jnp.int32)
        eidx = jax.ShapeDtypeStruct((b, 1, extra_topk), jnp.int32) if extra_topk else None
        plan = jsm.plan_decode(q, idx, topk_length=jnp.asarray(lens), extra_indices=eidx,
                               extra_topk_length=jnp.asarray(elens) if extra_topk else None, num_parts=num_parts)
        sched, num_splits = np.asarray(plan.sched), np.asarray(plan.num_splits)
        blocks = request_blocks(lens, topk, elens, extra_topk)
        done = [[] for _ in range(b)]
        pieces = [[] for _ in range(b)]
        for row in sched:
            br, er, bb, eb, bs = row[:5]
            for r in range(br, er + 1):
                lo = bb if r == br else 0
                hi = eb if r == er else blocks[r]
                done[r].extend(range(lo, hi))
                pieces[r].append(bs if r == br else 0)
        for r in range(b):
            assert sorted(done[r]) == list(range(blocks[r])), (r, done[r], blocks[r])
            assert pieces[r] == list(range(len(pieces[r])))
            assert num_splits[r + 1] - num_splits[r] == len(pieces[r])
        assert num_splits[-1] <= b + num_parts


def test_input_dtypes_and_rank4_cache(request):
    case = make_case(fresh_rng(), V32, b=2, s_q=1, h_q=16, topk=64, page_size=64, num_blocks=4)
    ref = _decode(**case)
    kv = case["kv_cache"]
    for variant in (kv[:, :, None, :], jax.lax.bitcast_convert_type(kv, jnp.int8),
                    jax.lax.bitcast_convert_type(kv, jnp.float8_e4m3fn)):
        got = _decode(**{**case, "kv_cache": variant})
        np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)), np.asarray(ref[0].astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))


def test_nan_in_unused_slots_never_leaks(request):
    case = make_case(fresh_rng(), MODEL1, b=2, s_q=2, h_q=16, topk=64, page_size=64, num_blocks=4,
                     invalid_fraction=0.5)
    out, lse = _decode(**case)
    assert not np.any(np.isnan(np.asarray(out.astype(jnp.float32))))
    assert not np.any(np.isnan(np.asarray(lse)))


def test_deterministic(request):
    case = make_case(fresh_rng(), V32, b=3, s_q=2, h_q=16, topk=200, page_size=64, num_blocks=8,
                     with_lengths=True)
    plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case["topk_length"], num_parts=7)
    a = _decode(**case, plan=plan)
    b = _decode(**case, plan=plan)
    np.testing.assert_array_equal(np.asarray(a[0].astype(jnp.float32)), np.asarray(b[0].astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_build_info():
    info = jsm.build_info()
    assert info["version"] == jsm.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["cuda_archs"], list)
    assert info["jaxlib"]
    if info["cuda"]:
        assert info["cuda_archs"]


def test_info_tells_build_from_gpu(monkeypatch, capsys):
    """`python -m jax_sparse_mla info` says which CUDA archs were built apart from whether JAX
    sees a GPU (it printed `cuda: True` on a machine without one)."""
    from jax_sparse_mla import __main__ as cli

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    real = jsm.build_info()
    for info in (real, {**real, "cuda": True, "cuda_archs": ["sm_90a"]}, {**real, "cuda": False, "cuda_archs": []}):
        monkeypatch.setattr(jsm, "build_info", lambda info=info: info)
        assert cli.main(["info"]) == 0
        lines = capsys.readouterr().out.splitlines()
        built = "yes, for " + ", ".join(info["cuda_archs"]) if info["cuda"] else "no"
        assert f"CUDA handlers built: {built}" in lines, lines
        seen = next(line for line in lines if line.startswith("GPUs JAX sees: "))
        assert seen == "GPUs JAX sees: none" if not gpus else all(str(d) in seen for d in gpus), lines
        if not gpus:
            note = " (the CUDA handlers were built but JAX sees no GPU)" if info["cuda"] else ""
            assert lines[-1] == f"decode runs on: the CPU handlers{note}", lines
        assert not any(line.startswith("cuda:") for line in lines), lines
    # Stand-in GPUs (any machine): an H200 runs the sm_90a handlers, an A100 does not.
    class FakeGpu:
        def __init__(self, i, kind, cc):
            self.id, self.device_kind, self.compute_capability = i, kind, cc

        def __str__(self):
            return f"cuda:{self.id}"

    fakes = [FakeGpu(0, "NVIDIA H200", "9.0"), FakeGpu(1, "NVIDIA A100", "8.0")]
    monkeypatch.setattr(jax, "devices", lambda backend=None: fakes)
    expected = {
        True: ("GPUs JAX sees: cuda:0 (NVIDIA H200, sm_90), cuda:1 (NVIDIA A100, sm_80)",
               "decode runs on: the CUDA handlers on 1 of 2 GPUs (the others are not sm_90a)"),
        False: ("GPUs JAX sees: cuda:0 (NVIDIA H200, sm_90), cuda:1 (NVIDIA A100, sm_80)",
                "decode runs on: the CPU handlers only: this build has no CUDA handlers, so a decode on the GPU fails"),
    }
    for built, (seen, where) in expected.items():
        monkeypatch.setattr(jsm, "build_info", lambda built=built: {**real, "cuda": built,
                                                                     "cuda_archs": ["sm_90a"] if built else []})
        assert cli.main(["info"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[-2:] == [seen, where], lines


def test_nan_in_used_slots_propagates_through_combine(request):
    """Corrupt (NaN) bytes in a slot that IS referenced give NaN, split or not: the combine
    pass must not mistake NaN pieces for empty ones."""
    case = make_case(fresh_rng(), V32, b=1, s_q=1, h_q=16, topk=256, page_size=64, num_blocks=8, nan_fill=False)
    case["indices"] = jnp.zeros_like(case["indices"])  # every entry: token 0
    case["kv_cache"] = case["kv_cache"].at[0, 0, :].set(0xFF)  # token 0: NaN codes and scales
    for num_parts in (1, 3):
        plan = jsm.plan_decode(case["q"], case["indices"], num_parts=num_parts)
        out, lse = _decode(**case, plan=plan)
        assert np.all(np.isnan(np.asarray(lse))), num_parts
        assert np.all(np.isnan(np.asarray(out.astype(jnp.float32)))), num_parts

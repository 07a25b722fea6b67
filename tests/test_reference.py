"""The pure-JAX reference (the definition of the op) against FlashMLA's conformance vectors and
against an independent float64 NumPy loop, plus the corner cases of docs/numerics.md (empty rows,
sink, masking)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import reference
from jax_sparse_mla.formats import KVFormat
from tests.utils import (
    CONFORMANCE_DIR,
    assert_lse_close,
    assert_out_close,
    conformance_files,
    conformance_kwargs,
    load_conformance,
    make_case,
    np_cache_to_rows,
    np_sparse_mla_decode,
)

V32, MODEL1 = KVFormat.V32, KVFormat.MODEL1
_ref = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _run(case):
    out, lse = _ref(**case)
    b, s_q, h_q, _ = case["q"].shape
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (b, h_q, s_q) and lse.dtype == jnp.float32
    return _f32(out), np.asarray(lse)


def _check_against_numpy(case):
    out, lse = _run(case)
    want_out, want_lse = np_sparse_mla_decode(**case)
    assert_out_close(out, want_out)
    assert_lse_close(lse, want_lse)
    return out, lse


# ---------------------------------------------------------------------------------------------
# FlashMLA conformance vectors


@pytest.mark.skipif(CONFORMANCE_DIR is None,
                    reason="no conformance vectors (tests/conformance_vectors)")
@pytest.mark.parametrize("path", conformance_files() or [None],
                         ids=lambda p: p.stem if p is not None else "none")
def test_conformance(path):
    v = load_conformance(path)
    kw = conformance_kwargs(v)
    out, lse = _run(kw)
    assert_out_close(out, _f32(v["out"]))
    assert_lse_close(lse, np.asarray(v["lse"]))
    # and the float64 loop agrees with the reference on the same inputs
    want_out, want_lse = np_sparse_mla_decode(**kw)
    assert_out_close(out, want_out)
    assert_lse_close(lse, want_lse)


def test_load_conformance_shapes():
    if CONFORMANCE_DIR is None:
        pytest.skip("no conformance vectors")
    for path in conformance_files():
        v = load_conformance(path)
        b, s_q, h_q, d_qk = v["q"].shape
        assert v["q"].dtype == jnp.bfloat16 and d_qk in (576, 512)
        assert v["kv"].dtype == jnp.uint8 and v["kv"].ndim == 4
        assert v["kv"].shape[-1] == KVFormat.from_d_qk(d_qk).bytes_per_token
        assert v["indices"].shape[:2] == (b, s_q) and v["indices"].dtype == jnp.int32
        assert v["out"].shape == (b, s_q, h_q, 512) and v["out"].dtype == jnp.bfloat16
        assert v["lse"].shape == (b, h_q, s_q)
        assert isinstance(v["sm_scale"], float)
        for k in ("topk_length", "attn_sink", "extra_kv", "extra_indices", "extra_topk_length"):
            assert k in v


# ---------------------------------------------------------------------------------------------
# random cases against the float64 loop

_CASES = {
    "v32_basic": (V32, dict(b=2, s_q=1, h_q=16, topk=64, page_size=64, num_blocks=4)),
    "m1_basic": (MODEL1, dict(b=2, s_q=1, h_q=16, topk=64, page_size=64, num_blocks=4)),
    "v32_mtp_lengths_sink": (V32, dict(b=4, s_q=3, h_q=8, topk=33, page_size=61, num_blocks=3,
                                       with_lengths=True, with_sink=True)),
    "m1_mtp_lengths_sink": (MODEL1, dict(b=4, s_q=2, h_q=8, topk=70, page_size=17, num_blocks=9,
                                         with_lengths=True, with_sink=True)),
    "v32_extra": (V32, dict(b=3, s_q=2, h_q=4, topk=20, page_size=64, num_blocks=2, extra_topk=45,
                            extra_page_size=5, extra_num_blocks=30, with_lengths=True, with_sink=True)),
    "m1_extra": (MODEL1, dict(b=4, s_q=1, h_q=4, topk=10, page_size=1, num_blocks=40, extra_topk=90,
                              extra_page_size=64, extra_num_blocks=3, with_lengths=True, with_sink=True)),
    "m1_extra_no_lengths": (MODEL1, dict(b=2, s_q=2, h_q=4, topk=7, page_size=3, num_blocks=11,
                                         extra_topk=13, extra_page_size=7, extra_num_blocks=4)),
    "v32_empty_row_sink": (V32, dict(b=2, s_q=2, h_q=4, topk=16, page_size=8, num_blocks=8,
                                     with_sink=True, empty_row=True)),
    "m1_empty_row_extra": (MODEL1, dict(b=2, s_q=3, h_q=4, topk=16, page_size=8, num_blocks=8,
                                        extra_topk=9, with_sink=True, empty_row=True)),
    "v32_mostly_invalid": (V32, dict(b=2, s_q=2, h_q=4, topk=40, page_size=16, num_blocks=8,
                                     invalid_fraction=0.7)),
    "m1_page1_topk1": (MODEL1, dict(b=3, s_q=1, h_q=2, topk=1, page_size=1, num_blocks=5,
                                    invalid_fraction=0.0, with_lengths=True)),
    "v32_h1_no_dups": (V32, dict(b=1, s_q=1, h_q=1, topk=129, page_size=64, num_blocks=4,
                                 duplicates=False)),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_against_float64_loop(name):
    fmt, kw = _CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    case = make_case(rng, fmt, **kw)
    out, lse = _check_against_numpy(case)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    if kw.get("empty_row"):
        assert np.all(out[-1, -1] == 0) and np.all(np.isposinf(lse[-1, :, -1]))
    if kw.get("with_lengths") and kw["b"] >= 2 and not kw.get("extra_topk"):
        # request 1 has topk_length 0 and nothing else: empty
        assert np.all(out[1] == 0) and np.all(np.isposinf(lse[1]))


def test_random_seeds_v32_and_model1():
    """A few more fresh seeds over mixed settings (both formats)."""
    rng = np.random.default_rng(12345)
    for fmt in (V32, MODEL1):
        for _ in range(3):
            case = make_case(rng, fmt, b=3, s_q=2, h_q=4, topk=24, page_size=16, num_blocks=6,
                             extra_topk=int(rng.integers(0, 2)) * 12, with_lengths=bool(rng.integers(0, 2)),
                             with_sink=bool(rng.integers(0, 2)))
            _check_against_numpy(case)


# ---------------------------------------------------------------------------------------------
# semantics (docs/numerics.md; docs/formats.md, which entries are read)


def _small(fmt=V32, **kw):
    args = dict(b=2, s_q=2, h_q=8, topk=24, page_size=16, num_blocks=6)
    args.update(kw)
    return make_case(np.random.default_rng(7), fmt, **args)


def test_sinks():
    case = _small(with_sink=False, sm_scale=None)
    out0, lse0 = _run(case)
    sink = np.array([np.inf, -np.inf, 0.0, 3.0, -2.0, 40.0, -40.0, 1.0], np.float32)
    out, lse = _run({**case, "attn_sink": jnp.asarray(sink)})
    np.testing.assert_array_equal(lse, lse0)  # lse never includes the sink
    assert np.all(out[:, :, 0] == 0)  # +inf sink: out = 0
    np.testing.assert_array_equal(out[:, :, 1], out0[:, :, 1])  # -inf sink: no effect
    factor = 1.0 / (1.0 + np.exp(sink[None, None, :].astype(np.float64) - lse.transpose(0, 2, 1)))
    assert_out_close(out, out0 * factor[..., None])


def test_empty_rows_ignore_sink():
    case = _small(with_sink=True, empty_row=True)
    sink = np.array([np.inf, -np.inf, 0.0, 3.0, -2.0, 40.0, -40.0, 1.0], np.float32)
    out, lse = _run({**case, "attn_sink": jnp.asarray(sink)})
    assert np.all(out[-1, -1] == 0) and np.all(np.isposinf(lse[-1, :, -1]))
    assert not np.isnan(out).any()


def test_all_empty_and_zero_topk():
    case = _small(with_sink=True)
    case["indices"] = jnp.full(case["indices"].shape, -1, jnp.int32)
    out, lse = _run(case)
    assert np.all(out == 0) and np.all(np.isposinf(lse))
    case["indices"] = jnp.zeros((2, 2, 0), jnp.int32)
    out, lse = _run(case)
    assert np.all(out == 0) and np.all(np.isposinf(lse))


def test_duplicates_count_twice():
    case = _small(nan_fill=False, sm_scale=None, topk=4)
    case["indices"] = jnp.asarray(np.tile(np.array([5, 5, 9, 9], np.int32), (2, 2, 1)))
    out_dup, lse_dup = _run(case)
    case["indices"] = jnp.asarray(np.tile(np.array([5, 9, -1, 2**31 - 1], np.int32), (2, 2, 1)))
    out_one, lse_one = _run(case)
    np.testing.assert_allclose(lse_dup, lse_one + np.log(2.0), rtol=1e-6)
    assert_out_close(out_dup, out_one)


def test_lengths_are_clamped():
    case = _small(nan_fill=False, with_lengths=False)
    topk = case["indices"].shape[-1]
    full = _run(case)
    clamped = _run({**case, "topk_length": jnp.array([topk + 100, 2**31 - 1], jnp.int32)})
    np.testing.assert_array_equal(full[0], clamped[0])
    np.testing.assert_array_equal(full[1], clamped[1])
    out, lse = _run({**case, "topk_length": jnp.array([-1, -(2**31)], jnp.int32)})
    assert np.all(out == 0) and np.all(np.isposinf(lse))
    # a prefix length equals cutting the list
    cut = {**case, "indices": case["indices"][:, :, :5]}
    a = _run({**case, "topk_length": jnp.array([5, 5], jnp.int32)})
    b = _run(cut)
    assert_lse_close(a[1], b[1])
    assert_out_close(a[0], b[0])


def test_invalid_entries_never_read():
    """NaN bytes in every slot no valid entry uses, including slot 0 and the last slot, which
    invalid entries would reach if they were clipped instead of masked."""
    case = _small(fmt=MODEL1, b=2, s_q=2, topk=24, page_size=16, num_blocks=12, invalid_fraction=0.5,
                  with_lengths=True)
    rows = np_cache_to_rows(np.asarray(case["kv_cache"]), "MODEL1").reshape(12 * 16, -1)
    assert np.all(rows[0] == 0xFF) and np.all(rows[-1] == 0xFF), "pick another seed"
    out, lse = _check_against_numpy(case)
    assert not np.isnan(out).any() and not np.isnan(lse).any()


def test_extra_list_is_part_of_the_same_softmax():
    """Main + extra over the same cache equals one concatenated list."""
    case = _small(nan_fill=False, with_sink=True)
    idx = np.asarray(case["indices"])
    split = {**case, "indices": jnp.asarray(idx[..., :10]), "extra_kv_cache": case["kv_cache"],
             "extra_indices": jnp.asarray(idx[..., 10:])}
    a, b = _run(case), _run(split)
    assert_out_close(b[0], a[0])
    assert_lse_close(b[1], a[1])


def test_cache_variants_and_defaults():
    case = _small(fmt=MODEL1, sm_scale=None)
    base = _run(case)
    kv = case["kv_cache"]
    for v in (kv[:, :, None, :], jax.lax.bitcast_convert_type(kv, jnp.int8),
              jax.lax.bitcast_convert_type(kv, jnp.float8_e4m3fn)[:, :, None, :]):
        got = _run({**case, "kv_cache": v})
        np.testing.assert_array_equal(got[0], base[0])
        np.testing.assert_array_equal(got[1], base[1])
    explicit = _run({**case, "sm_scale": 512 ** -0.5})
    np.testing.assert_array_equal(explicit[1], base[1])
    # plan is ignored; sm_scale may be traced
    traced = jax.jit(reference.sparse_mla_decode)(**case, sm_scale=jnp.float32(512 ** -0.5), plan=None)
    np.testing.assert_allclose(np.asarray(traced[1]), base[1], rtol=1e-6)
    eager = reference.sparse_mla_decode(**case, plan=object())
    np.testing.assert_array_equal(np.asarray(eager[1]), base[1])


def test_dequantized_tokens():
    case = _small(fmt=V32, nan_fill=False)
    tok = reference.dequantized_tokens(case["kv_cache"])
    assert tok.shape == (6 * 16, 576) and tok.dtype == jnp.bfloat16


def test_make_case_properties():
    rng = np.random.default_rng(0)
    case = make_case(rng, V32, b=4, s_q=2, h_q=8, topk=64, page_size=64, num_blocks=8,
                     extra_topk=20, with_lengths=True, with_sink=True, sm_scale=0.1)
    n_tok = 8 * 64
    idx = np.asarray(case["indices"])
    for bad in (-1, -(2**31), n_tok, n_tok + 7, 2**31 - 1):
        assert np.any(idx == bad), bad
    valid = idx[(idx >= 0) & (idx < n_tok)]
    assert len(np.unique(valid)) < len(valid)  # duplicates
    lens = np.asarray(case["topk_length"])
    assert lens[0] == 64 and lens[1] == 0 and (lens[3] < 0 or lens[3] > 64)
    sink = np.asarray(case["attn_sink"])
    assert np.isposinf(sink[1]) and np.isneginf(sink[2])
    kv = np.asarray(case["kv_cache"])
    assert np.any(np.all(kv == 0xFF, axis=-1))  # NaN-filled unused slots
    assert case["sm_scale"] == 0.1 and isinstance(case["sm_scale"], float)
    assert set(case) == {"q", "kv_cache", "indices", "topk_length", "attn_sink", "extra_kv_cache",
                         "extra_indices", "extra_topk_length", "sm_scale"}
    plain = make_case(rng, MODEL1, b=1, s_q=1, h_q=2, topk=4, page_size=2, num_blocks=3, sm_scale=None)
    assert set(plain) == {"q", "kv_cache", "indices"}
    assert plain["q"].shape == (1, 1, 2, 512) and plain["kv_cache"].shape == (3, 2, 584)


# ---------------------------------------------------------------------------------------------
# errors


def test_errors():
    case = _small(nan_fill=False, sm_scale=None)
    f = reference.sparse_mla_decode
    with pytest.raises(TypeError, match=r"q must have dtype bfloat16, got float32"):
        f(**{**case, "q": case["q"].astype(jnp.float32)})
    with pytest.raises(ValueError, match=r"q must have rank 4"):
        f(**{**case, "q": case["q"][0]})
    with pytest.raises(ValueError, match=r"d_qk.*got d_qk=128"):
        f(**{**case, "q": case["q"][..., :128]})
    with pytest.raises(ValueError, match=r"kv_cache last dim .* must be 584 for format MODEL1, got 656"):
        f(**{**case, "q": case["q"][..., :512]})
    with pytest.raises(ValueError, match=r"indices must have shape \(2, 2, 24\), got \(1, 2, 24\)"):
        f(**{**case, "indices": case["indices"][:1]})
    with pytest.raises(TypeError, match=r"indices must have an integer dtype"):
        f(**{**case, "indices": case["indices"].astype(jnp.float32)})
    with pytest.raises(ValueError, match=r"topk_length must have shape \(2,\), got \(3,\)"):
        f(**case, topk_length=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(8,\), got \(4,\)"):
        f(**case, attn_sink=jnp.zeros(4, jnp.float32))
    with pytest.raises(ValueError, match=r"extra_kv_cache and extra_indices must be given together"):
        f(**case, extra_kv_cache=case["kv_cache"])
    with pytest.raises(ValueError, match=r"extra_topk_length given without extra_indices"):
        f(**case, extra_topk_length=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"extra_kv_cache last dim"):
        f(**case, extra_kv_cache=jnp.zeros((2, 3, 584), jnp.uint8), extra_indices=case["indices"])

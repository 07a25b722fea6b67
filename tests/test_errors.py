"""Bad input fails at trace time with a message that names the argument and
shows what was expected and what came."""

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm


def _ok(b=2, s_q=1, h_q=16, topk=8, d_qk=576, bpt=656, nb=4, ps=16):
    return dict(
        q=jnp.zeros((b, s_q, h_q, d_qk), jnp.bfloat16),
        kv_cache=jnp.zeros((nb, ps, bpt), jnp.uint8),
        indices=jnp.zeros((b, s_q, topk), jnp.int32),
    )


def _raises(exc, pattern, **over):
    args = {**_ok(), **over}
    with pytest.raises(exc, match=pattern):
        jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))(**args)


def test_valid_call_compiles():
    out, lse = jsm.sparse_mla_decode(**_ok())
    assert out.shape == (2, 1, 16, 512) and lse.shape == (2, 16, 1)


def test_q_rank():
    _raises(ValueError, r"q: expected shape \[b, s_q, h_q, d_qk\]", q=jnp.zeros((2, 16, 576), jnp.bfloat16))


def test_q_dtype():
    _raises(TypeError, r"q: expected dtype bfloat16, got float32", q=jnp.zeros((2, 1, 16, 576), jnp.float32))


def test_d_qk():
    _raises(ValueError, r"q: expected last dim d_qk in \{576 \(V32\), 512 \(MODEL1\)\}, got d_qk=600", q=jnp.zeros((2, 1, 16, 600), jnp.bfloat16))


def test_cache_bytes_do_not_match_format():
    _raises(ValueError, r"kv_cache: last dim must be V32's bytes_per_token 656.*got 584",
            kv_cache=jnp.zeros((4, 16, 584), jnp.uint8))


def test_cache_dtype():
    _raises(TypeError, r"kv_cache: expected dtype uint8, int8, float8_e4m3fn, got float32",
            kv_cache=jnp.zeros((4, 16, 656), jnp.float32))


def test_cache_rank4_needs_one():
    _raises(ValueError, r"kv_cache: a rank-4 cache must be", kv_cache=jnp.zeros((4, 16, 2, 656), jnp.uint8))


def test_indices_batch_mismatch():
    _raises(ValueError, r"indices: expected shape \[b, s_q, topk\] = \(2, 1, topk >= 1\), got \(3, 1, 8\)",
            indices=jnp.zeros((3, 1, 8), jnp.int32))


def test_indices_dtype():
    _raises(TypeError, r"indices: expected dtype int32, got float32", indices=jnp.zeros((2, 1, 8), jnp.float32))


def test_topk_length_shape():
    _raises(ValueError, r"topk_length: expected shape \[b\] = \(2,\), got \(2, 1\)",
            topk_length=jnp.zeros((2, 1), jnp.int32))


def test_topk_length_dtype():
    _raises(TypeError, r"topk_length: expected dtype int32, got float32", topk_length=jnp.zeros((2,), jnp.float32))


def test_sink_shape_and_dtype():
    _raises(ValueError, r"attn_sink: expected shape \[h_q\] = \(16,\), got \(8,\)",
            attn_sink=jnp.zeros((8,), jnp.float32))
    _raises(TypeError, r"attn_sink: expected dtype float32, got bfloat16", attn_sink=jnp.zeros((16,), jnp.bfloat16))


def test_extra_indices_without_cache():
    _raises(ValueError, r"extra_indices: given without extra_kv_cache", extra_indices=jnp.zeros((2, 1, 8), jnp.int32))


def test_extra_cache_without_indices():
    _raises(ValueError, r"extra_kv_cache: given without extra_indices", extra_kv_cache=jnp.zeros((4, 16, 656), jnp.uint8))


def test_extra_lengths_without_extra():
    _raises(ValueError, r"extra_topk_length: given without", extra_topk_length=jnp.zeros((2,), jnp.int32))


def test_extra_cache_format():
    _raises(ValueError, r"extra_kv_cache: last dim must be V32's bytes_per_token 656",
            extra_kv_cache=jnp.zeros((4, 16, 584), jnp.uint8), extra_indices=jnp.zeros((2, 1, 8), jnp.int32))


def test_sm_scale_must_be_static_and_positive():
    with pytest.raises(TypeError, match=r"sm_scale: expected a static Python float"):
        jax.jit(lambda s, **kw: jsm.sparse_mla_decode(**kw, sm_scale=s))(jnp.float32(0.1), **_ok())
    _raises(ValueError, r"sm_scale: expected a finite value > 0, got -1.0", sm_scale=-1.0)
    _raises(TypeError, r"sm_scale: expected a static Python float, got str", sm_scale="0.1")


def test_plan_mismatch():
    plan = jsm.plan_decode(jnp.zeros((2, 1, 16, 576), jnp.bfloat16), jnp.zeros((2, 1, 16), jnp.int32))
    _raises(ValueError, r"plan: made for \(b, topk, extra_topk\) = \(2, 16, 0\), but this call has \(2, 8, 0\)", plan=plan)
    _raises(TypeError, r"plan: expected a DecodePlan", plan=(1, 2))


def test_plan_num_parts():
    q, idx = jnp.zeros((2, 1, 16, 576), jnp.bfloat16), jnp.zeros((2, 1, 16), jnp.int32)
    for bad in (0, 2**40, 1.5):
        with pytest.raises(ValueError, match=r"num_parts: expected an int in \[1, 65536\], got "):
            jsm.plan_decode(q, idx, num_parts=bad)


def test_plan_shapes():
    idx = jnp.zeros((2, 1, 16), jnp.int32)
    with pytest.raises(ValueError, match=r"q: b, s_q and h_q must be >= 1, got shape \(2, 1, 0, 576\)"):
        jsm.plan_decode(jnp.zeros((2, 1, 0, 576), jnp.bfloat16), idx)
    with pytest.raises(ValueError, match=r"extra_indices: expected shape \[b, s_q, extra_topk\] = \(2, 1, extra_topk >= 1\)"):
        jsm.plan_decode(jnp.zeros((2, 1, 16, 576), jnp.bfloat16), idx, extra_indices=jnp.zeros((2, 1, 0), jnp.int32),
                        extra_topk_length=jnp.zeros((2,), jnp.int32))


def test_stale_plan_is_refused():
    """A plan made for shorter lengths would skip blocks: the CPU handler refuses it."""
    args = _ok(topk=256)
    plan = jsm.plan_decode(args["q"], args["indices"], topk_length=jnp.array([64, 64], jnp.int32), num_parts=3)
    with pytest.raises(Exception, match=r"plan does not match topk_length"):
        jax.block_until_ready(jsm.sparse_mla_decode(**args, topk_length=jnp.array([256, 256], jnp.int32), plan=plan))
    # Same block counts (lengths 200 and 250 both need 4 blocks): the plan is valid for both.
    plan = jsm.plan_decode(args["q"], args["indices"], topk_length=jnp.array([200, 200], jnp.int32), num_parts=3)
    jax.block_until_ready(jsm.sparse_mla_decode(**args, topk_length=jnp.array([250, 256], jnp.int32), plan=plan))

"""jax.vmap of sparse_mla_decode, plan_decode and write_kv: mapped dims fold into the batch;
every mapped element equals the op (or the reference) called on that element alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import reference
from tests.utils import assert_lse_close, assert_out_close, fresh_rng, make_case

N = 3  # mapped elements
SHAPE = dict(s_q=1, h_q=16, topk=64, page_size=32, num_blocks=4)
_reference = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))


def _close(out, lse, ref_out, ref_lse):
    assert_out_close(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
    assert_lse_close(np.asarray(lse), np.asarray(ref_lse))


def _mapped_call(names, in_axes, sm_scale=None):
    """jit(vmap(f)) over positional arrays named `names`."""

    def f(*arrays):
        return jsm.sparse_mla_decode(**dict(zip(names, arrays)), sm_scale=sm_scale)

    return jax.jit(jax.vmap(f, in_axes=in_axes))


def _stack(cases, key):
    return jnp.stack([c[key] for c in cases])


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_everything_mapped_own_caches(fmt):
    """Each element has its own caches (stacked into one), lengths, sink and extra list."""
    rng = fresh_rng()
    cases = [make_case(rng, fmt, b=2, **SHAPE, extra_topk=32, extra_page_size=16, with_lengths=True,
                       with_sink=True, sm_scale=0.05) for _ in range(N)]
    names = [k for k in cases[0] if k != "sm_scale"]
    out, lse = _mapped_call(names, 0, sm_scale=0.05)(*(_stack(cases, k) for k in names))
    assert out.shape == (N, 2, 1, 16, 512) and lse.shape == (N, 2, 16, 1)
    for i, case in enumerate(cases):
        _close(out[i], lse[i], *_reference(**case))


def test_shared_cache_mapped_requests():
    """One cache shared by all elements (unmapped), requests mapped at a non-leading axis,
    vmapped twice (nested folds)."""
    rng = fresh_rng()
    b = 2
    case = make_case(rng, "V32", b=N * 2 * b, **SHAPE, with_lengths=True, with_sink=True, sm_scale=None)
    ref_out, ref_lse = _reference(**case)

    def split(x):  # [N*2*b, ...] -> [b, N, 2, ...]: mapped axes 1 (outer) and 1 (inner)
        return jnp.moveaxis(x.reshape(N, 2, b, *x.shape[1:]), 2, 0)

    def f(q, idx, lens):
        return jsm.sparse_mla_decode(q, case["kv_cache"], idx, topk_length=lens, attn_sink=case["attn_sink"])

    inner = jax.vmap(f, in_axes=(1, 1, 1))
    out, lse = jax.jit(jax.vmap(inner, in_axes=(1, 1, 1)))(split(case["q"]), split(case["indices"]),
                                                          split(case["topk_length"]))
    assert out.shape == (N, 2, b, 1, 16, 512)
    _close(out.reshape(ref_out.shape), lse.reshape(ref_lse.shape), ref_out, ref_lse)


def test_mapped_sink_only():
    """Only attn_sink is mapped (per-element sinks, e.g. a stack of layers): the kernel gets one
    sink row per folded request; infinite sinks and empty rows keep their rules (docs/numerics.md)."""
    rng = fresh_rng()
    case = make_case(rng, "MODEL1", b=4, **SHAPE, with_lengths=True, with_sink=True, empty_row=True,
                     sm_scale=None)
    sinks = np.stack([np.asarray(case["attn_sink"]), rng.normal(0, 3, 16).astype(np.float32),
                      np.full(16, -np.inf, np.float32)])
    sinks[1, 5] = np.inf
    f = jax.jit(jax.vmap(lambda s: jsm.sparse_mla_decode(
        case["q"], case["kv_cache"], case["indices"], topk_length=case["topk_length"], attn_sink=s)))
    out, lse = f(jnp.asarray(sinks))
    for i in range(N):
        _close(out[i], lse[i], *_reference(**{**case, "attn_sink": jnp.asarray(sinks[i])}))


def test_folded_batch_gets_its_own_unsplit():
    """A passed plan that cuts neither of its 2 requests; vmap over 2 elements folds 4 requests,
    whose plan (same worker count) cuts one: the folded call must run the combine again."""
    rng = fresh_rng()
    cases = [make_case(rng, "V32", b=2, s_q=1, h_q=16, topk=300, page_size=64, num_blocks=16, sm_scale=None)
             for _ in range(2)]
    plan = jsm.plan_decode(cases[0]["q"], cases[0]["indices"], num_parts=3)
    folded = jsm.plan_decode(jax.ShapeDtypeStruct((4, 1, 16, 576), jnp.bfloat16),
                             jax.ShapeDtypeStruct((4, 1, 300), jnp.int32), num_parts=3)
    assert plan.unsplit and not folded.unsplit
    q, kv, idx = (_stack(cases, k) for k in ("q", "kv_cache", "indices"))
    out, lse = jax.jit(jax.vmap(lambda q, kv, i: jsm.sparse_mla_decode(q, kv, i, plan=plan)))(q, kv, idx)
    for i, case in enumerate(cases):
        _close(out[i], lse[i], *_reference(**case))


def test_plans_under_vmap():
    """plan_decode under vmap gives one plan per element; a plan passed into a vmapped decode
    (mapped or not) is replaced by one for the folded batch, keeping its worker count."""
    rng = fresh_rng()
    cases = [make_case(rng, "V32", b=2, **SHAPE, with_lengths=True, sm_scale=None) for _ in range(N)]
    q, kv, idx, lens = (_stack(cases, k) for k in ("q", "kv_cache", "indices", "topk_length"))

    def step(q, kv, idx, lens):
        plan = jsm.plan_decode(q, idx, topk_length=lens, num_parts=5)
        return plan, jsm.sparse_mla_decode(q, kv, idx, topk_length=lens, plan=plan)

    plans, (out, lse) = jax.jit(jax.vmap(step))(q, kv, idx, lens)
    assert plans.sched.shape == (N, 5, 8) and plans.num_splits.shape == (N, 3)
    for i, case in enumerate(cases):
        one = jsm.plan_decode(case["q"], case["indices"], topk_length=case["topk_length"], num_parts=5)
        np.testing.assert_array_equal(plans.sched[i], one.sched)
        np.testing.assert_array_equal(plans.num_splits[i], one.num_splits)
        _close(out[i], lse[i], *_reference(**case))

    # Only the plan mapped: one decode, broadcast.
    case = cases[0]
    one = jsm.plan_decode(case["q"], case["indices"], topk_length=case["topk_length"], num_parts=3)
    stacked = jax.tree.map(lambda x: jnp.stack([x] * N), one)
    out, lse = jax.vmap(lambda p: jsm.sparse_mla_decode(case["q"], case["kv_cache"], case["indices"],
                                                        topk_length=case["topk_length"], plan=p))(stacked)
    for i in range(N):
        _close(out[i], lse[i], *_reference(**case))


def test_mapped_cache_too_large_for_int32():
    cache = jax.ShapeDtypeStruct((2, 2**16, 2**15, 656), jnp.uint8)  # 2 * 2**31 token slots
    q = jax.ShapeDtypeStruct((2, 1, 1, 16, 576), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((2, 1, 1, 64), jnp.int32)
    with pytest.raises(NotImplementedError, match="kv_cache.*int32"):
        jax.eval_shape(jax.vmap(jsm.sparse_mla_decode), q, cache, idx)


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_write_kv_vmap(fmt):
    rng = fresh_rng()
    d_qk = 576 if fmt == "V32" else 512
    nbytes = 656 if fmt == "V32" else 584
    caches = jnp.asarray(rng.integers(0, 255, (N, 3, 8, nbytes), dtype=np.uint8))
    k_new = jnp.asarray(rng.standard_normal((N, 4, d_qk), dtype=np.float32), jnp.bfloat16)
    slots = jnp.asarray(np.stack([rng.permutation(24)[:4] for _ in range(N)]).astype(np.int32))
    slots = slots.at[1, 2].set(-1)  # dropped
    write = jax.jit(jsm.write_kv)
    mapped = jax.jit(jax.vmap(write))(caches, k_new, slots)
    for i in range(N):
        np.testing.assert_array_equal(mapped[i], write(caches[i], k_new[i], slots[i]))
    # An unmapped cache with mapped writes: each element updates its own copy.
    shared = jax.jit(jax.vmap(write, in_axes=(None, 0, 0)))(caches[0], k_new, slots)
    for i in range(N):
        np.testing.assert_array_equal(shared[i], write(caches[0], k_new[i], slots[i]))

"""Property test: on any small problem hypothesis draws (format, shapes, page sizes, lengths,
extra cache, sink, worker count), the FFI pipeline equals the reference within the tolerances
(docs/numerics.md)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_sparse_mla as jsm
from jax_sparse_mla import reference
from tests.utils import assert_lse_close, assert_out_close, make_case

problems = st.fixed_dictionaries(dict(
    fmt=st.sampled_from(["V32", "MODEL1"]),
    b=st.integers(1, 4),
    s_q=st.integers(1, 3),
    h_q=st.sampled_from([1, 3, 16, 64]),
    topk=st.integers(1, 200),
    page_size=st.sampled_from([1, 5, 16, 64]),
    num_blocks=st.integers(1, 12),
    extra_topk=st.sampled_from([0, 0, 1, 70]),
    extra_page_size=st.sampled_from([3, 64]),
    with_lengths=st.booleans(),
    with_sink=st.booleans(),
    invalid_fraction=st.sampled_from([0.0, 0.1, 0.9]),
    num_parts=st.sampled_from([None, 1, 2, 7, 40]),
    seed=st.integers(0, 2**31 - 1),
))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems)
def test_matches_reference(p):
    rng = np.random.default_rng(p["seed"])
    case = make_case(rng, p["fmt"], b=p["b"], s_q=p["s_q"], h_q=p["h_q"], topk=p["topk"],
                     page_size=p["page_size"], num_blocks=p["num_blocks"], extra_topk=p["extra_topk"],
                     extra_page_size=p["extra_page_size"], extra_num_blocks=4, with_lengths=p["with_lengths"],
                     with_sink=p["with_sink"], invalid_fraction=p["invalid_fraction"])
    plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case.get("topk_length"),
                           extra_indices=case.get("extra_indices"),
                           extra_topk_length=case.get("extra_topk_length"), num_parts=p["num_parts"])
    out, lse = jsm.sparse_mla_decode(**case, plan=plan)
    ref_out, ref_lse = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))(**case)
    assert_out_close(np.asarray(out.astype(jnp.float32)), np.asarray(ref_out.astype(jnp.float32)))
    assert_lse_close(np.asarray(lse), np.asarray(ref_lse))

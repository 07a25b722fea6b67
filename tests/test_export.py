"""jax.export of a jitted decode step using the op: serialize, deserialize, call; the same
results as calling the step directly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_sparse_mla as jsm
from jax_sparse_mla import sharding
from tests.utils import make_case

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")


def _case(fmt):
    rng = np.random.default_rng(7)
    return make_case(rng, fmt, b=2, s_q=1, h_q=16, topk=64, page_size=32, num_blocks=4, with_lengths=True,
                     with_sink=True, sm_scale=None)


def _step(q, kv_cache, indices, lengths, sink, k_new, slots):
    """One decode step: write the new tokens' keys into the cache, then attend."""
    kv_cache = jsm.write_kv(kv_cache, k_new, slots)
    out, lse = jsm.sparse_mla_decode(q, kv_cache, indices, topk_length=lengths, attn_sink=sink)
    return out, lse, kv_cache


def _args(case):
    d_qk = case["q"].shape[-1]
    k_new = jax.random.normal(jax.random.key(0), (2, d_qk), jnp.float32).astype(jnp.bfloat16)
    slots = case["indices"][:, 0, 0]  # overwrite a token each request attends to
    return (case["q"], case["kv_cache"], case["indices"], case["topk_length"], case["attn_sink"], k_new, slots)


def test_disabled_checks_tuple():
    checks = jsm.export_disabled_checks()
    assert checks == tuple(export.DisabledSafetyCheck.custom_call(n) for n in jsm.EXPORT_CUSTOM_CALL_TARGETS)
    assert len(checks) == 3


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_round_trip_cpu_and_cuda(fmt):
    args = _args(_case(fmt))
    step = jax.jit(_step)
    exported = export.export(step, platforms=("cpu", "cuda"), disabled_checks=jsm.export_disabled_checks())(*args)
    blob = exported.serialize()
    restored = export.deserialize(blob)
    assert restored.platforms == ("cpu", "cuda")
    got, want = restored.call(*args), step(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # The op's targets are custom calls: export refuses them unless the checks are disabled.
    with pytest.raises(ValueError, match="custom calls whose targets"):
        export.export(step, platforms=("cpu",))(*args)


def test_vmapped_and_shard_map_export():
    """A vmapped decode and a 2-device shard_map decode export too."""
    case = _case("V32")
    stacked = {k: jnp.stack([v, v]) for k, v in case.items()}
    vf = jax.jit(jax.vmap(lambda q, c, i, n: jsm.sparse_mla_decode(q, c, i, topk_length=n)))
    vargs = (stacked["q"], stacked["kv_cache"], stacked["indices"], stacked["topk_length"])
    restored = export.deserialize(export.export(vf, disabled_checks=jsm.export_disabled_checks())(*vargs).serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(*vargs)[0]), np.asarray(vf(*vargs)[0]))

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices")
    mesh = Mesh(np.asarray(devices[:2]), ("tp",))
    f = jax.jit(sharding.shard_map_decode(mesh, head_axis="tp"))
    q = jax.device_put(case["q"], NamedSharding(mesh, P(None, None, "tp")))
    kv = jax.device_put(case["kv_cache"], NamedSharding(mesh, P()))
    idx = jax.device_put(case["indices"], NamedSharding(mesh, P()))
    lens = jax.device_put(case["topk_length"], NamedSharding(mesh, P()))
    exported = export.export(f, disabled_checks=jsm.export_disabled_checks())(q, kv, idx, topk_length=lens)
    assert exported.nr_devices == 2
    restored = export.deserialize(exported.serialize())
    got = jax.jit(restored.call)(q, kv, idx, topk_length=lens)
    want = f(q, kv, idx, topk_length=lens)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))

"""sparse_mla_decode split over heads (TP) and requests (DP) on 8 CPU host devices (see
conftest.py), through plain jax.jit with NamedSharding inputs and inside shard_map; equal to the
unsharded op within the tolerances (docs/numerics.md), and the compiled program free of
collectives (docs/sharding.md). The layouts of an n-device host (TP n, DP n, DP 2 x TP n/2;
`mesh_layouts`) run on the 8 CPU devices and, marked multigpu, on every GPU of the machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_sparse_mla as jsm
from jax_sparse_mla import reference, sharding
from tests.utils import assert_lse_close, assert_out_close, collectives, fresh_rng, make_case, mesh_layouts

_decode = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))
_reference = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))


@pytest.fixture(autouse=True)
def _unsharded_on_cpu(request):
    """Outside the multigpu tests the cases and the unsharded op live on the CPU, like the CPU
    meshes: on a GPU host the default device would compare the GPU kernel with the CPU one, whose
    roundings differ by more than the tolerance allows (seen: ~2e-3 on a few elements)."""
    if request.node.get_closest_marker("multigpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _cpus(n):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return devices[:n]


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _mesh(devices, dp, tp):
    return Mesh(np.asarray(devices[: dp * tp]).reshape(dp, tp), ("dp", "tp"))


def _close(got, want):
    assert_out_close(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert_lse_close(np.asarray(got[1]), np.asarray(want[1]))


def _case(rng, fmt="V32", b=8, h_q=128, **kw):
    return make_case(rng, fmt, b=b, s_q=kw.pop("s_q", 1), h_q=h_q, topk=64, page_size=32, num_blocks=8,
                     with_lengths=True, with_sink=True, sm_scale=None, **kw)


def _run_jit(mesh, case, *, batch_axis, head_axis, plan=None):
    """Returns (out, lse) of the jit-sharded op and the compiled HLO text."""
    placed = sharding.shard_decode_inputs(mesh, case, batch_axis=batch_axis, head_axis=head_axis)
    compiled = _decode.lower(**placed, plan=plan).compile()
    out, lse = compiled(**placed, plan=plan)
    want = sharding.output_shardings(mesh, batch_axis=batch_axis, head_axis=head_axis)
    assert out.sharding.is_equivalent_to(want[0], 4), out.sharding
    assert lse.sharding.is_equivalent_to(want[1], 3), lse.sharding
    return (out, lse), compiled.as_text()


def _check_hlo(hlo, case, b_local, h_local):
    found = collectives(hlo)
    assert not found, f"collectives in the compiled program: {found}"
    d_qk = case["q"].shape[-1]
    local_q = f"bf16[{b_local},{case['q'].shape[1]},{h_local},{d_qk}]"
    decode_lines = [line for line in hlo.splitlines() if 'custom_call_target="jsm_decode"' in line]
    assert decode_lines and all(local_q in line for line in decode_lines), (local_q, decode_lines)
    n_tokens = case["kv_cache"].shape[0] * case["kv_cache"].shape[1]
    assert all(f"u8[{case['kv_cache'].shape[0]},{case['kv_cache'].shape[1]}," in line for line in decode_lines), (
        f"the decode should read the whole ({n_tokens}-token) replicated cache")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_jit(tp):
    """TP over a 128-head layer: 16 heads per device at TP 8."""
    case = _case(fresh_rng(), b=2)
    want = _decode(**case)
    got, hlo = _run_jit(_mesh(_cpus(tp), 1, tp), case, batch_axis=None, head_axis="tp")
    _close(got, want)
    _check_hlo(hlo, case, 2, 128 // tp)


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_jit(dp):
    case = _case(fresh_rng(), fmt="MODEL1", b=8, h_q=64, extra_topk=32, extra_page_size=16)
    want = _decode(**case)
    got, hlo = _run_jit(_mesh(_cpus(dp), dp, 1), case, batch_axis="dp", head_axis=None)
    _close(got, want)
    _check_hlo(hlo, case, 8 // dp, 64)


def test_dp_times_tp_jit_with_plans():
    """DP 2 x TP 4, with and without a user plan (re-planned per shard since requests split),
    and TP 8 with a user plan (kept: its worker count shows in the partial buffers)."""
    rng = fresh_rng()
    case = _case(rng, b=4, s_q=2)
    want = _reference(**case)
    mesh = _mesh(_cpus(8), 2, 4)
    plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case["topk_length"], num_parts=5)
    for p in (None, plan):
        got, hlo = _run_jit(mesh, case, batch_axis="dp", head_axis="tp", plan=p)
        _close(got, want)
        _check_hlo(hlo, case, 2, 32)
    assert "f32[7,2,32,512]" in hlo  # b_local + 5 workers of partials
    got, hlo = _run_jit(_mesh(_cpus(8), 1, 8), case, batch_axis=None, head_axis="tp", plan=plan)
    _close(got, want)
    assert "f32[9,2,16,512]" in hlo  # the passed plan: b + 5 workers


def test_mesh_axes_both_on_batch():
    """Requests split over two mesh axes at once (a tuple entry in the PartitionSpec)."""
    case = _case(fresh_rng(), b=8, h_q=16)
    mesh = _mesh(_cpus(8), 2, 4)
    got, hlo = _run_jit(mesh, case, batch_axis=("dp", "tp"), head_axis=None)
    _close(got, _decode(**case))
    _check_hlo(hlo, case, 1, 16)


@pytest.mark.parametrize("dp,tp", [(1, 8), (4, 1), (2, 2)])
def test_shard_map(dp, tp):
    case = _case(fresh_rng(), b=4)
    f = jax.jit(sharding.shard_map_decode(_mesh(_cpus(dp * tp), dp, tp), batch_axis="dp", head_axis="tp"))
    _close(f(**case), _decode(**case))


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_own_pools(tp):
    """Each of 4 devices owns a cache pool (and an extra-cache pool) and its requests address
    it with local ids."""
    rng = fresh_rng()
    dp = 4
    cases = [make_case(rng, "V32", b=2, s_q=1, h_q=32, topk=64, page_size=32, num_blocks=4, extra_topk=16,
                       with_lengths=True, with_sink=True, sm_scale=0.04) for _ in range(dp)]
    for c in cases[1:]:
        c["attn_sink"] = cases[0]["attn_sink"]  # heads are shared by every device
    glob = {k: jnp.concatenate([c[k] for c in cases]) for k in cases[0] if k not in ("attn_sink", "sm_scale")}
    glob["attn_sink"] = cases[0]["attn_sink"]
    mesh = _mesh(_cpus(dp * tp), dp, tp)
    f = jax.jit(sharding.data_parallel_decode(mesh, "dp", head_axis="tp" if tp > 1 else None),
                static_argnames=("sm_scale",))
    compiled = f.lower(**glob, sm_scale=0.04).compile()
    assert not collectives(compiled.as_text())
    out, lse = compiled(**glob)
    for d, c in enumerate(cases):
        _close((out[2 * d: 2 * d + 2], lse[2 * d: 2 * d + 2]), _reference(**c))


def test_helpers_reject_bad_axes():
    mesh = _mesh(_cpus(4), 2, 2)
    with pytest.raises(ValueError, match="not an axis"):
        sharding.decode_shardings(mesh, batch_axis="data")
    with pytest.raises(ValueError, match="share a mesh axis"):
        sharding.decode_shardings(mesh, batch_axis="dp", head_axis="dp")
    with pytest.raises(ValueError, match="cache_axis"):
        sharding.shard_map_decode(mesh, batch_axis="dp", cache_axis="tp")


def test_vmap_inside_jit_sharded():
    """vmap over a group axis of requests split DP2 x TP4 under jit: the fold keeps the batch
    split contiguous, so the program has no collective, and the result equals the unsharded op."""
    rng = fresh_rng()
    mesh = _mesh(_cpus(8), 2, 4)
    n = 2
    cases = [_case(rng, b=4, h_q=32, nan_fill=False) for _ in range(n)]
    kv = cases[0]["kv_cache"]
    q = jnp.stack([c["q"] for c in cases])
    idx = jnp.stack([c["indices"] for c in cases])
    lens = jnp.stack([c["topk_length"] for c in cases])
    sink = cases[0]["attn_sink"]
    qs = jax.device_put(q, jax.NamedSharding(mesh, jax.P(None, "dp", None, "tp", None)))
    ids = jax.device_put(idx, jax.NamedSharding(mesh, jax.P(None, "dp")))
    ls = jax.device_put(lens, jax.NamedSharding(mesh, jax.P(None, "dp")))
    step = jax.jit(jax.vmap(lambda q, i, l: jsm.sparse_mla_decode(q, kv, i, topk_length=l, attn_sink=sink)))
    compiled = step.lower(qs, ids, ls).compile()
    found = collectives(compiled.as_text())
    assert not found, f"collectives in the compiled program: {found}"
    out, lse = compiled(qs, ids, ls)
    assert out.sharding.spec[1] == "dp" and out.sharding.spec[3] == "tp", out.sharding
    for i, case in enumerate(cases):
        case = {**case, "kv_cache": kv, "attn_sink": sink}
        _close((out[i], lse[i]), _decode(**case))


def _check_layout(devices, layout):
    """One layout of `mesh_layouts(len(devices), 128)` on `devices`: a 128-head layer, through
    jit and through shard_map, each equal to the op on the first device alone, and neither
    program with a collective (the cache is read in place)."""
    layouts = mesh_layouts(len(devices), 128)
    if layout not in layouts:
        pytest.skip(f"no {layout} layout on {len(devices)} devices")
    dp, tp = layouts[layout]
    case = _case(fresh_rng(), b=2 * dp)
    with jax.default_device(devices[0]):
        want = _decode(**case)
    mesh = _mesh(devices, dp, tp)
    batch_axis, head_axis = "dp" if dp > 1 else None, "tp" if tp > 1 else None
    got, hlo = _run_jit(mesh, case, batch_axis=batch_axis, head_axis=head_axis)
    _close(got, want)
    _check_hlo(hlo, case, 2, 128 // tp)
    placed = sharding.shard_decode_inputs(mesh, case, batch_axis=batch_axis, head_axis=head_axis)
    mapped = jax.jit(sharding.shard_map_decode(mesh, batch_axis="dp", head_axis="tp")).lower(**placed).compile()
    _close(mapped(**placed), want)
    _check_hlo(mapped.as_text(), case, 2, 128 // tp)


@pytest.mark.parametrize("layout", ["tp", "dp", "dp2_tp"])
def test_layouts_on_8_cpus(layout):
    _check_layout(_cpus(8), layout)


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["tp", "dp", "dp2_tp"])
def test_layouts_on_all_gpus(layout):
    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    _check_layout(gpus, layout)

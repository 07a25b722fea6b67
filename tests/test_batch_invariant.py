"""Batch-invariant decode (README "Reproducibility"): with `batch_invariant=True` a request's
`out` and `lse` are the same bits decoded alone, anywhere in any batch of other requests, with any
`num_parts`, under vmap, jax.export and every sharding on the 8 CPU devices (conftest.py).

The cases have requests of one and of two chunks (lengths straddling the 32-block chunk, the
extra list adding the blocks that cross it), sinks (+-inf heads included) and extra caches; every
comparison is bit for bit.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_sparse_mla as jsm
from jax_sparse_mla import sharding
from jax_sparse_mla.op import _ffi
from tests.utils import fresh_rng, make_case, request_blocks

C = _ffi.CHUNK_BLOCKS
ENTRIES = 64  # list entries per block (split_plan.h)
TOPK, EXTRA_TOPK = C * ENTRIES + 152, 100  # C + 3 and 2 blocks: at most two chunks
POOL = 8  # requests sharing one cache
_decode = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale", "batch_invariant"))
_PER_REQUEST = ("q", "indices", "topk_length", "extra_indices", "extra_topk_length")


def _pool(rng, fmt, b=POOL, h_q=16):
    """`b` requests over shared caches; half the main lengths near top-k (mostly two chunks), some
    past it or negative (clamped), extra lengths anywhere in [0, extra_topk]. One request, at a
    random position, is always past one chunk on its main list alone, so every pool splits one."""
    case = make_case(rng, fmt, b=b, s_q=2, h_q=h_q, topk=TOPK, page_size=64, num_blocks=40, extra_topk=EXTRA_TOPK,
                     extra_page_size=16, extra_num_blocks=16, with_lengths=True, with_sink=True, nan_fill=False,
                     sm_scale=0.05)
    near = rng.integers(TOPK - 200, TOPK + 30, b)
    lens = np.where(rng.random(b) < 0.5, near, rng.integers(-3, TOPK + 1, b))
    lens[rng.integers(b)] = rng.integers(C * ENTRIES + 1, TOPK + 30)
    case["topk_length"] = jnp.asarray(lens, jnp.int32)
    case["extra_topk_length"] = jnp.asarray(rng.integers(0, EXTRA_TOPK + 1, b), jnp.int32)
    return case


def _rows(case, rows):
    """The batch of requests `rows` (any order, repeats allowed) over the same caches."""
    rows = np.asarray(rows)
    return {k: v[rows] if k in _PER_REQUEST else v for k, v in case.items()}


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _assert_same(got, want, what=""):
    for g, w, name in zip(got, want, ("out", "lse")):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{what} {name}")


def _run(case, **kw):
    return _decode(**case, batch_invariant=True, **kw)


def _alone(case):
    """Each request of `case` decoded on its own: [(out [1, ...], lse [1, ...])]."""
    return [_run(_rows(case, [i])) for i in range(case["q"].shape[0])]


def _assert_rows(got, alone, rows, what):
    for j, i in enumerate(rows):
        _assert_same((got[0][j:j + 1], got[1][j:j + 1]), alone[i], f"{what}: position {j} (request {i})")


def _plan(case, **kw):
    return jsm.plan_decode(case["q"], case["indices"], topk_length=case["topk_length"],
                           extra_indices=case["extra_indices"], extra_topk_length=case["extra_topk_length"],
                           batch_invariant=True, **kw)


def _check_batches(rng, fmt):
    case = _pool(rng, fmt)
    alone = _alone(case)
    perm = rng.permutation(POOL)
    sub = rng.choice(POOL, size=int(rng.integers(2, POOL)), replace=True)  # repeats allowed
    for rows, what in ((np.arange(POOL), "whole batch"), (perm, "permuted"), (sub, "sub-batch")):
        _assert_rows(_run(_rows(case, rows)), alone, rows, what)
    # Any worker count: a plan with extra (empty) workers gives the same bits.
    plan = _plan(case, num_parts=POOL * 2 + int(rng.integers(1, 40)))
    _assert_rows(_run(case, plan=plan), alone, range(POOL), f"num_parts={plan.num_parts}")
    # The list's padded size does not matter either: a longer top-k with the same lengths.
    padded = dict(case, topk_length=jnp.clip(case["topk_length"], 0, TOPK))
    pad = rng.integers(-1, case["kv_cache"].shape[0] * 64, (POOL, 2, 64), dtype=np.int32)
    padded["indices"] = jnp.concatenate([case["indices"], jnp.asarray(pad)], axis=2)
    _assert_rows(_run(padded), alone, range(POOL), "top-k padded")
    return case


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_request_alone_equals_any_batch(fmt):
    """Alone == whole batch == permuted == sub-batch with repeats == any num_parts == padded top-k;
    and the pool does split requests (some have two pieces)."""
    case = _check_batches(fresh_rng(), fmt)
    assert np.any(np.diff(np.asarray(_plan(case).num_splits)) == 2)


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_vmap_folding(fmt):
    """vmap over groups of requests: a shared cache (requests mapped), and own caches and sinks
    per element (stacked into one cache, one sink row per folded request)."""
    _check_vmap(fresh_rng(), fmt)


def _check_vmap(rng, fmt):
    pools = [_pool(rng, fmt, b=3) for _ in range(2)]
    alone = [_alone(p) for p in pools]

    def decode(q, kv, idx, lens, ekv, eidx, elens, sink):
        return jsm.sparse_mla_decode(q, kv, idx, topk_length=lens, extra_kv_cache=ekv, extra_indices=eidx,
                                     extra_topk_length=elens, attn_sink=sink, sm_scale=0.05, batch_invariant=True)

    names = ("q", "kv_cache", "indices", "topk_length", "extra_kv_cache", "extra_indices", "extra_topk_length",
             "attn_sink")
    stacked = [jnp.stack([p[k] for p in pools]) for k in names]
    out, lse = jax.jit(jax.vmap(decode))(*stacked)
    for e in range(2):
        _assert_rows((out[e], lse[e]), alone[e], range(3), f"own caches, element {e}")
    # One cache shared by both elements: element e is requests rows[e] of pools[0].
    rows = rng.permutation(6) % 3
    rows = rows.reshape(2, 3)
    shared = [pools[0][k][rows] if k in _PER_REQUEST else pools[0][k] for k in names]
    axes = tuple(0 if k in _PER_REQUEST else None for k in names)
    out, lse = jax.jit(jax.vmap(decode, in_axes=axes))(*shared)
    for e in range(2):
        _assert_rows((out[e], lse[e]), alone[0], rows[e], f"shared cache, element {e}")


def test_plan_chunks():
    """The plan: request r's chunk k is blocks [Ck, min(Ck + C, blocks(r))) and one piece (slot
    num_splits[r] + k); workers hold runs of whole chunks in request order, never two chunks of
    one request; rows past the last used one are empty; the worker count is the larger of
    1 + b * (max_chunks - 1) and the default (or the caller's num_parts); a batch of one-chunk
    requests is balanced within one chunk per worker."""
    rng = fresh_rng()
    for _ in range(30):
        _check_plan(rng)
    for _ in range(10):
        _check_plan(rng, balanced=True)


def _check_plan(rng, balanced=False):
    b = int(rng.integers(1, 7)) if not balanced else int(rng.integers(20, 300))
    topk = int(rng.integers(1, 5000)) if not balanced else int(rng.integers(1, C * ENTRIES + 1))
    extra_topk = int(rng.choice([0, int(rng.integers(1, 1500))])) if not balanced else 0
    lens = rng.integers(-10, topk + 10, b).astype(np.int32)
    extra_lens = rng.integers(-10, extra_topk + 10, b).astype(np.int32)
    q = jax.ShapeDtypeStruct((b, 1, 16, 576), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((b, 1, topk), jnp.int32)
    extra = dict(extra_indices=jax.ShapeDtypeStruct((b, 1, extra_topk), jnp.int32),
                 extra_topk_length=jnp.asarray(extra_lens)) if extra_topk else {}
    max_blocks = max(math.ceil(topk / ENTRIES), 1) + math.ceil(extra_topk / ENTRIES)
    need = 1 + b * (math.ceil(max_blocks / C) - 1)
    blocks = [int(n) for n in request_blocks(lens, topk, extra_lens, extra_topk)]
    chunks = [math.ceil(n / C) for n in blocks]
    for num_parts in (None, need + int(rng.integers(0, 9))):
        plan = jsm.plan_decode(q, idx, topk_length=jnp.asarray(lens), num_parts=num_parts, batch_invariant=True,
                               **extra)
        assert plan.batch_invariant
        assert plan.num_parts == (num_parts or max(need, jsm.default_num_parts(1, 16)))
        np.testing.assert_array_equal(np.asarray(plan.num_splits), np.concatenate([[0], np.cumsum(chunks)]))
        sched = np.asarray(plan.sched)
        used = [row for row in sched if row[0] <= row[1]]
        assert all((row == [b, b - 1, 0, 0, 0, 0, 0, 0]).all() for row in sched[len(used):]), "empty rows last"
        pieces, loads = [], []
        for br, er, bb, eb, split, first, last, zero in used:
            assert (split, first, last, zero) == (bb // C, bb == 0, eb == blocks[er], 0)
            load = 0
            for r in range(br, er + 1):
                start, end = (bb if r == br else 0), (eb if r == er else blocks[r])
                assert start % C == 0 and end == min(start + C, blocks[r]), f"row piece {r}: [{start}, {end})"
                pieces.append((r, start // C))
                load += end - start + 5
            loads.append(load)
        assert pieces == [(r, k) for r in range(b) for k in range(chunks[r])], "every chunk once, in order"
        if balanced:  # one-chunk requests: each worker within one chunk of an even share
            total = sum(n + 5 for n in blocks)
            assert max(loads) <= total / plan.num_parts + C + 5, (max(loads), total, plan.num_parts)


def test_bad_arguments():
    case = _pool(np.random.default_rng(0), "V32", b=2)
    for bad in (1, 0, None, "yes", np.bool_(True)):
        with pytest.raises(TypeError, match=r"batch_invariant: expected a Python bool .*got "):
            jsm.plan_decode(case["q"], case["indices"], batch_invariant=bad)
        with pytest.raises(TypeError, match=r"batch_invariant: expected a Python bool"):
            jsm.sparse_mla_decode(**case, batch_invariant=bad)
    # A plan of the other mode is refused, either way round.
    default_plan = jsm.plan_decode(case["q"], case["indices"], topk_length=case["topk_length"],
                                   extra_indices=case["extra_indices"], extra_topk_length=case["extra_topk_length"])
    with pytest.raises(ValueError, match="made with batch_invariant=False, but this call has batch_invariant=True"):
        jsm.sparse_mla_decode(**case, plan=default_plan, batch_invariant=True)
    with pytest.raises(ValueError, match="made with batch_invariant=True, but this call has batch_invariant=False"):
        jsm.sparse_mla_decode(**case, plan=_plan(case))
    # Too few workers to keep 2 requests x 2 chunks apart (1 + 2 * 1 = 3), and too many requests.
    with pytest.raises(ValueError, match=r"num_parts: .* expected num_parts >= 3 \(or None\), got 2"):
        _plan(case, num_parts=2)
    big = jax.ShapeDtypeStruct((40000, 1, 16, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="need 120001 workers, more than 65536"):
        jsm.plan_decode(big, jax.ShapeDtypeStruct((40000, 1, 4 * C * ENTRIES), jnp.int32), batch_invariant=True)


def _cpus(n):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return devices[:n]


def _mesh(dp, tp):
    return Mesh(np.asarray(_cpus(dp * tp)).reshape(dp, tp), ("dp", "tp"))


def _check_sharded(rng, fmt):
    case = _pool(rng, fmt)
    want = _run(case)
    _assert_rows(want, _alone(case), range(POOL), "unsharded")
    plan = _plan(case, num_parts=3 * POOL)
    for dp, tp, p in ((2, 1, None), (8, 1, None), (1, 8, None), (2, 4, None), (2, 4, plan), (1, 4, plan)):
        mesh = _mesh(dp, tp)
        axes = dict(batch_axis="dp" if dp > 1 else None, head_axis="tp" if tp > 1 else None)
        placed = sharding.shard_decode_inputs(mesh, case, **axes)
        got = _run(placed, plan=p)
        assert got[0].sharding.is_equivalent_to(sharding.output_shardings(mesh, **axes)[0], 4)
        _assert_same(got, want, f"jit dp={dp} tp={tp} plan={p is not None}")
        mapped = jax.jit(sharding.shard_map_decode(mesh, **axes), static_argnames=("sm_scale", "batch_invariant"))
        _assert_same(mapped(**placed, batch_invariant=True), want, f"shard_map dp={dp} tp={tp}")


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_sharded_equals_unsharded(fmt):
    """Requests over 2 and 8 devices, heads over 8, DP 2 x TP 4 (with and without a passed plan),
    TP 4 with a passed plan (kept): under jit with NamedShardings and under shard_map."""
    _check_sharded(fresh_rng(), fmt)


def _check_own_pools(rng, fmt, dp=4, tp=2):
    """data_parallel_decode: each device's requests address its own cache pool."""
    pools = [_pool(rng, fmt, b=2) for _ in range(dp)]
    for p in pools[1:]:
        p["attn_sink"] = pools[0]["attn_sink"]
    glob = {k: jnp.concatenate([p[k] for p in pools]) for k in pools[0] if k not in ("attn_sink", "sm_scale")}
    f = jax.jit(sharding.data_parallel_decode(_mesh(dp, tp), "dp", head_axis="tp"),
                static_argnames=("sm_scale", "batch_invariant"))
    out, lse = f(**glob, attn_sink=pools[0]["attn_sink"], sm_scale=0.05, batch_invariant=True)
    for d, p in enumerate(pools):
        _assert_rows((out[2 * d:2 * d + 2], lse[2 * d:2 * d + 2]), _alone(p), range(2), f"device {d}")


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_data_parallel_own_pools(fmt):
    _check_own_pools(fresh_rng(), fmt)


def test_export_round_trip():
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    _check_export(fresh_rng(), "MODEL1")


def _check_export(rng, fmt):
    from jax import export

    case = _pool(rng, fmt, b=3)
    args = {k: v for k, v in case.items() if k != "sm_scale"}
    step = jax.jit(lambda a: jsm.sparse_mla_decode(**a, sm_scale=0.05, batch_invariant=True))
    exported = export.export(step, disabled_checks=jsm.export_disabled_checks())(args)
    restored = export.deserialize(exported.serialize())
    _assert_rows(restored.call(args), _alone(case), range(3), "exported")

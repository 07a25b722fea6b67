"""Integer inputs at any width: ids outside the cache are masked (indices) or dropped (write_kv
slots) and lengths are clamped, never wrapped onto real tokens. With JAX's default (x64 off),
`jnp.asarray` narrows int64 to int32 by dropping the high bits, so t + k * 2**32 becomes t.

The x64 half runs in a subprocess (`python -m tests.test_int_width SEED`): x64 is a process-wide
switch that must be set before JAX computes anything.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_sparse_mla as jsm
from jax_sparse_mla import reference, sharding
from tests.utils import REPO_ROOT, fresh_rng, make_case, np_quantize_kv, random_keys

V32, MODEL1 = jsm.KVFormat.V32, jsm.KVFormat.MODEL1


def _aliases(rng, targets):
    """int64 values that int32 narrowing turns into `targets`: t + k * 2**32, k != 0 of either sign."""
    k = rng.integers(1, 2**30, size=np.shape(targets)) * rng.choice([-1, 1], size=np.shape(targets))
    return np.asarray(targets, np.int64) + k * 2**32


def _write_case(rng, fmt, num_blocks=6, page_size=8, n=10):
    num_tokens = num_blocks * page_size
    cache = jnp.asarray(np_quantize_kv(random_keys(rng, fmt.name, num_blocks, page_size), fmt.name))
    k_new = jnp.asarray(random_keys(rng, fmt.name, 1, n)[0])
    tokens = rng.choice(num_tokens, 2 * n, replace=False)
    slots, others = tokens[:n].astype(np.int64), tokens[n:]  # `others` are never written
    bad = rng.random(n) < 0.5
    bad[0] = True
    slots[bad] = _aliases(rng, others[bad])
    return cache, k_new, slots, bad, others[bad]


def _changed_tokens(before, after):
    b = np.asarray(before).reshape(before.shape[0], -1)
    a = np.asarray(after).reshape(after.shape[0], -1)
    per_page = before.shape[1]
    if before.shape[-1] == 656:  # V32: token t is row t
        return set(np.flatnonzero(np.any(a.reshape(-1, 656) != b.reshape(-1, 656), axis=-1)))
    # MODEL1 is page-planar: map changed bytes back to their tokens
    changed = set()
    for page, pos in zip(*np.nonzero(a != b)):
        t = pos // 576 if pos < per_page * 576 else (pos - per_page * 576) // 8
        changed.add(int(page) * per_page + int(t))
    return changed


@pytest.mark.parametrize("fmt", [V32, MODEL1])
def test_write_kv_drops_wide_slots(fmt):
    rng = fresh_rng()
    cache, k_new, slots, bad, aliased = _write_case(rng, fmt)
    want = jsm.write_kv(cache, k_new, np.where(bad, -1, slots).astype(np.int32))
    for given in (slots, slots.tolist(), slots.astype(np.uint64)):  # int64, Python ints, uint64
        got = jsm.write_kv(cache, k_new, given)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert _changed_tokens(cache, got) == set(slots[~bad].tolist())
    # What int32 narrowing would have done: overwrite the aliased tokens.
    wrapped = jsm.write_kv(cache, k_new, slots.astype(np.int32))
    assert set(aliased.tolist()) <= _changed_tokens(cache, wrapped)


def test_write_kv_python_ints_past_64_bits():
    rng = fresh_rng()
    cache, k_new, _, _, _ = _write_case(rng, V32, n=3)
    got = jsm.write_kv(cache, k_new, [2**70 + 1, -(2**70) + 2, 5])
    assert _changed_tokens(cache, got) == {5}


def _wide_decode_case(rng, fmt):
    extra = fmt == MODEL1
    # No NaN-filled slots: the lengths below open entries make_case left unused.
    case = make_case(rng, fmt, b=3, s_q=2, h_q=16, topk=48, page_size=16, num_blocks=6, with_lengths=True,
                     nan_fill=False, extra_topk=24 if extra else 0, extra_page_size=8, extra_num_blocks=3)
    wide, masked = {}, {}
    for key, cache in (("indices", "kv_cache"), ("extra_indices", "extra_kv_cache")):
        if key not in case:
            continue
        idx = np.asarray(case[key]).astype(np.int64)
        num_tokens = case[cache].shape[0] * case[cache].shape[1]
        bad = rng.random(idx.shape) < 0.2
        targets = rng.integers(0, num_tokens, size=idx.shape)  # real tokens the wrap would read
        wide[key] = np.where(bad, _aliases(rng, targets), idx)
        masked[key] = jnp.asarray(np.where(bad, -1, idx).astype(np.int32))
    for key in ("topk_length", "extra_topk_length"):
        if key not in case:
            continue
        lens = np.asarray(case[key]).astype(np.int64)
        lens[0] += 2**32  # narrows to the same length: stays
        lens[1] = 2**33 + 1  # narrows to 1, means "all"
        lens[2] = -(2**32) + 3  # narrows to 3, means "none"
        wide[key] = lens
        topk = case[key.replace("topk_length", "indices")].shape[-1]
        masked[key] = jnp.asarray(np.clip(lens, 0, topk).astype(np.int32))
    return case, wide, masked


@pytest.mark.parametrize("fmt", [V32, MODEL1])
def test_decode_masks_wide_indices(fmt):
    case, wide, masked = _wide_decode_case(fresh_rng(), fmt)
    want = jsm.sparse_mla_decode(**{**case, **masked})
    got = jsm.sparse_mla_decode(**{**case, **wide})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    plan = jsm.plan_decode(case["q"], wide["indices"], topk_length=wide["topk_length"],
                           extra_indices=wide.get("extra_indices"), extra_topk_length=wide.get("extra_topk_length"))
    for g, w in zip(jsm.sparse_mla_decode(**{**case, **wide}, plan=plan), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    ref_want = reference.sparse_mla_decode(**{**case, **masked})
    for g, w in zip(reference.sparse_mla_decode(**{**case, **wide}), ref_want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # What int32 narrowing would have done: read real tokens instead.
    wrapped = jsm.sparse_mla_decode(**{**case, **{k: v.astype(np.int32) for k, v in wide.items()}})
    assert not np.array_equal(np.asarray(wrapped[1]), np.asarray(want[1]))


def test_sharding_helpers_mask_wide_indices():
    """shard_decode_inputs (device_put) and shard_map_decode (shard_map) convert host arrays too."""
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices (conftest.py asks XLA for 8)")
    mesh = Mesh(np.asarray(devices[:2]).reshape(1, 2), ("dp", "tp"))
    case, wide, masked = _wide_decode_case(fresh_rng(), MODEL1)
    decode = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))
    want = decode(**sharding.shard_decode_inputs(mesh, {**case, **masked}, head_axis="tp"))
    got = decode(**sharding.shard_decode_inputs(mesh, {**case, **wide}, head_axis="tp"))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    mapped = sharding.shard_map_decode(mesh, head_axis="tp")
    want = mapped(**{**case, **masked})
    for g, w in zip(mapped(**{**case, **wide}), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_ids_a_32_bit_jax_cannot_hold():
    """A cache of 2**32 tokens (traced only, never allocated): a valid id past int32 is refused,
    not narrowed; an invalid one is still just dropped / masked."""
    huge = jax.ShapeDtypeStruct((2**16, 2**16, 656), jnp.uint8)
    k_new = jnp.zeros((1, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"write_kv: slots: id 2147483653 lies in the cache \(4294967296 "
                                         r"tokens\) but needs 64 bits; enable jax_enable_x64"):
        jax.eval_shape(lambda c: jsm.write_kv(c, k_new, np.array([2**31 + 5])), huge)
    jax.eval_shape(lambda c: jsm.write_kv(c, k_new, np.array([2**32 + 5])), huge)
    q = jnp.zeros((1, 1, 16, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"indices: id 2147483653 lies in the cache .* the kernels take int32 ids"):
        jax.eval_shape(lambda c: jsm.sparse_mla_decode(q, c, np.array([[[2**31 + 5]]])), huge)


def test_with_x64():
    seed = int(fresh_rng().integers(2**32))
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.test_int_width", str(seed)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("x64 ok"), proc.stdout


def _x64_worker(seed: int) -> None:
    """int64 JAX arrays (x64 on), also inside jit: same results as int32 with the bad ids -1."""
    assert jax.config.jax_enable_x64
    rng = np.random.default_rng(seed)
    for fmt in (V32, MODEL1):
        cache, k_new, slots, bad, _ = _write_case(rng, fmt)
        want = jsm.write_kv(cache, k_new, np.where(bad, -1, slots).astype(np.int32))
        for given in (jnp.asarray(slots), jnp.asarray(slots.astype(np.uint64))):
            assert given.dtype in (jnp.int64, jnp.uint64)
            np.testing.assert_array_equal(np.asarray(jax.jit(jsm.write_kv)(cache, k_new, given)), np.asarray(want))

        case, wide, masked = _wide_decode_case(rng, fmt)
        wide = {k: jnp.asarray(v) for k, v in wide.items()}
        assert all(v.dtype == jnp.int64 for v in wide.values())
        decode = jax.jit(jsm.sparse_mla_decode, static_argnames=("sm_scale",))
        want = decode(**{**case, **masked})
        for g, w in zip(decode(**{**case, **wide}), want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        ref = jax.jit(reference.sparse_mla_decode, static_argnames=("sm_scale",))
        for g, w in zip(ref(**{**case, **wide}), ref(**{**case, **masked})):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        # uint32 ids past int32 (any x64 setting): masked too
        idx = np.asarray(masked["indices"]).astype(np.int64)
        big = np.where(idx < 0, 2**31 + 7, idx).astype(np.uint32)
        for g, w in zip(decode(**{**case, **masked, "indices": jnp.asarray(big)}), want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    print("x64 ok")


if __name__ == "__main__":
    _x64_worker(int(sys.argv[1]))

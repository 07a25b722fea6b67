"""The Flax NNX MLA layer: while the context is shorter than top-k it equals dense MLA
attention computed naively in float32 from the same weights and the dequantized cache; its TP
annotations split heads, and the sharded layer equals the unsharded one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402
from jax_sparse_mla import formats  # noqa: E402
from jax_sparse_mla import nnx as jnnx  # noqa: E402

SMALL = dict(dim=64, n_heads=8, q_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=2,
             index_head_dim=64, page_size=8)


def _step(layer, x, cache, pos, table, dense):
    return layer(x, cache, pos, table, dense=dense)


_jit_step = nnx.jit(_step, static_argnames="dense")


def _assert_close(got, want, rel=1e-2):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want))
    err = np.max(np.abs(got - want))
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} * max |ref| {scale:.3g}"
    cos = np.sum(got * want) / np.sqrt(np.sum(got * got) * np.sum(want * want))
    assert cos > 0.9999, cos


def _decode_steps(config, steps, s=1, batch=3, seed=0):
    """Runs `steps` calls of `s` tokens; each call's sparse output is checked against the dense
    path on the same cache. Returns the number of cached tokens at the end."""
    layer = jnnx.MLAAttention(config, rngs=nnx.Rngs(seed))
    table, num_blocks = jnnx.make_block_table(batch, 48, config.page_size, seed=seed)
    cache = jnnx.init_layer_cache(config, num_blocks, batch)
    pos = jnp.asarray([0, 2, 5][:batch], jnp.int32)  # requests at different lengths
    key = jax.random.key(seed)
    for _ in range(steps):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (batch, s, config.dim), jnp.float32)
        y, new_cache = _jit_step(layer, x, cache, pos, table, False)
        y_dense, dense_cache = _jit_step(layer, x, cache, pos, table, True)
        assert y.shape == (batch, s, config.dim)
        _assert_close(y, y_dense)
        np.testing.assert_array_equal(new_cache.kv, dense_cache.kv)
        cache, pos = new_cache, pos + s
    return int(pos.max())


def test_v32_equals_dense_mla():
    """V32 with an attention sink; decode steps and an MTP-style call of 3 tokens."""
    config = jnnx.MLAConfig(**SMALL, index_topk=16, attn_sink=True)
    assert _decode_steps(config, steps=4) < 16
    assert _decode_steps(config, steps=3, s=3) < 16


def test_model1_with_window_equals_dense_mla():
    """MODEL1 (d_qk 512, V includes the RoPE dims) with a sliding window in the extra cache:
    top-k plus the window cover the context."""
    config = jnnx.MLAConfig(**SMALL, fmt="MODEL1", index_topk=8, window=6, attn_sink=True)
    assert _decode_steps(config, steps=6) < 8 + 6


def test_batch_invariant_layer():
    """MLAConfig.batch_invariant reaches the op (its plan is made in that mode, with the default
    worker count: 3 requests of one chunk need only 1) and the layer still equals dense attention."""
    config = jnnx.MLAConfig(**SMALL, index_topk=16, attn_sink=True, batch_invariant=True)
    assert _decode_steps(config, steps=2) < 16
    layer = jnnx.MLAAttention(config, rngs=nnx.Rngs(0))
    table, num_blocks = jnnx.make_block_table(3, 32, config.page_size)
    cache = jnnx.init_layer_cache(config, num_blocks, 3)
    x = jnp.zeros((3, 1, config.dim), jnp.float32)
    graphdef, state = nnx.split(layer)
    hlo = jax.jit(lambda state, *a: nnx.merge(graphdef, state)(*a)).lower(
        state, x, cache, jnp.zeros((3,), jnp.int32), table).compile().as_text()
    plans = [line for line in hlo.splitlines() if 'custom_call_target="jsm_plan"' in line]
    parts = jsm.default_num_parts(1, config.n_heads)
    assert plans and all(f"(s32[{parts},8]" in line and "batch_invariant = true" in line for line in plans), plans
    with pytest.raises(TypeError, match="MLAConfig.batch_invariant: expected a Python bool"):
        jnnx.MLAConfig(batch_invariant="yes")


def test_indexer_limits_attention_beyond_topk():
    """With more context than top-k the layer attends to top-k tokens only (not dense)."""
    config = jnnx.MLAConfig(**SMALL, index_topk=4)
    layer = jnnx.MLAAttention(config, rngs=nnx.Rngs(1))
    table, num_blocks = jnnx.make_block_table(2, 32, config.page_size)
    cache = jnnx.init_layer_cache(config, num_blocks, 2)
    x = jax.random.normal(jax.random.key(1), (2, 12, config.dim), jnp.float32)
    pos = jnp.zeros((2,), jnp.int32)
    # Fill 12 tokens through the dense path, then one decode step.
    _, cache = _jit_step(layer, x[:, :12], cache, pos, table, True)
    y, _ = _jit_step(layer, x[:, :1], cache, pos + 12, table, False)
    y_dense, _ = _jit_step(layer, x[:, :1], cache, pos + 12, table, True)
    assert np.max(np.abs(np.asarray(y) - np.asarray(y_dense))) > 1e-3


def test_partition_specs():
    config = jnnx.MLAConfig(**SMALL, attn_sink=True)
    specs = nnx.get_partition_spec(nnx.state(jnnx.MLAAttention(config, rngs=nnx.Rngs(0)), nnx.Param))
    assert specs["wq_b"]["kernel"].get_value() == P(None, "tp")
    assert specs["w_uk"].get_value() == P("tp", None, None)
    assert specs["w_uv"].get_value() == P("tp", None, None)
    assert specs["wo"]["kernel"].get_value() == P("tp", None)
    assert specs["sink"].get_value() == P("tp")
    assert specs["wkv_a"]["kernel"].get_value() == P(None, None)


def test_tensor_parallel_layer():
    """Parameters placed by their partition specs on 4 CPU devices: the op runs 2 of the 8
    heads per device on the replicated cache (no all-gather of q or of the cache)."""
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices")
    mesh = Mesh(np.asarray(devices[:4]), ("tp",))
    config = jnnx.MLAConfig(**SMALL, index_topk=16, attn_sink=True)
    layer = jnnx.MLAAttention(config, rngs=nnx.Rngs(0))
    table, num_blocks = jnnx.make_block_table(2, 32, config.page_size)
    cache = jnnx.init_layer_cache(config, num_blocks, 2)
    x = jax.random.normal(jax.random.key(2), (2, 1, config.dim), jnp.float32)
    pos = jnp.asarray([3, 7], jnp.int32)
    want, _ = _jit_step(layer, x, cache, pos, table, False)

    graphdef, state = nnx.split(layer)
    specs = nnx.get_partition_spec(state)
    state = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), state, specs)
    replicated = NamedSharding(mesh, P())
    args = jax.device_put((x, cache, pos, table), replicated)

    def pure(state, x, cache, pos, table):
        return nnx.merge(graphdef, state)(x, cache, pos, table)

    compiled = jax.jit(pure).lower(state, *args).compile()
    got, _ = compiled(state, *args)
    _assert_close(got, want)
    hlo = compiled.as_text()
    decode = [line for line in hlo.splitlines() if 'custom_call_target="jsm_decode"' in line]
    assert decode and all("bf16[2,1,2,576]" in line for line in decode), decode
    gathered = [line for line in hlo.splitlines() if re.search(r"\ball-gather", line)]
    assert not [line for line in gathered if "u8[" in line or ",576]" in line], gathered


# ---- an independent reference: no cache, no absorption, complex-number RoPE ----------------

def _rope_complex(x, pos, theta):
    """RoPE on the halves convention written with complex numbers (independent of jnnx.rope)."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d // 2) * 2.0 / d)
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * pos * freq)
    return np.concatenate([z.real, z.imag], -1)


def _w(m):
    return np.asarray(m.kernel[...], np.float64)


def _rms(v, m):
    return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * np.asarray(m.scale[...], np.float64)


def _naive_entries(layer, xs, c):
    """Every token's cache entry `[b, T, d_qk]` [normed latent | RoPE'd k_pe], recomputed from
    the hidden states `xs [b, T, dim]` and rounded through FP8 like the cache."""
    kv = np.asarray(xs, np.float64) @ _w(layer.wkv_a)
    latent = _rms(kv[..., : c.latent_dim], layer.kv_norm)
    k_pe = np.stack([_rope_complex(kv[:, j, c.latent_dim:], j, c.rope_theta) for j in range(xs.shape[1])], 1)
    fmt = c.kv_format
    entries = jnp.asarray(np.concatenate([latent, k_pe], -1), jnp.bfloat16).reshape(-1, fmt.d_qk)
    entries = formats.dequantize_tokens(formats.quantize_tokens(entries, fmt), fmt)
    return np.asarray(entries.astype(jnp.float32), np.float64).reshape(*xs.shape[:2], fmt.d_qk)


def _naive_mla(layer, xs, entries, t, c, keep=None):
    """float64 MLA of the token at position t over the entries of positions 0..t (those with
    `keep [b, t+1]` true, when given), with per-head up-projection instead of absorption."""
    entries = entries[:, : t + 1]
    latent, k_pe = entries[..., : c.latent_dim], entries[..., c.latent_dim:]
    k_nope = np.einsum("btc,hnc->bthn", latent, np.asarray(layer.w_uk[...], np.float64))
    v = np.einsum("btc,hcv->bthv", entries[..., :512], np.asarray(layer.w_uv[...], np.float64))
    x = np.asarray(xs[:, t], np.float64)
    q = (_rms(x @ _w(layer.wq_a), layer.q_norm) @ _w(layer.wq_b)).reshape(x.shape[0], c.n_heads, -1)
    q_nope, q_pe = q[..., : c.qk_nope_head_dim], _rope_complex(q[..., c.qk_nope_head_dim:], t, c.rope_theta)
    logits = (np.einsum("bhn,bthn->bht", q_nope, k_nope) + np.einsum("bhr,btr->bht", q_pe, k_pe)) * (
        c.qk_nope_head_dim + c.rope_dim) ** -0.5
    if keep is not None:
        logits = np.where(keep[:, None, :], logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    denom = p.sum(-1, keepdims=True)
    o = np.einsum("bht,bthv->bhv", p / denom, v)
    if layer.sink is not None:
        lse = (np.log(denom) + m)[..., 0]
        o = o / (1 + np.exp(np.asarray(layer.sink[...], np.float64)[None, :] - lse))[..., None]
    return o.reshape(x.shape[0], -1) @ _w(layer.wo)


def _layer_and_history(c, b, steps, seed):
    """A fresh layer, its empty cache and block table, random hidden states `[b, steps, dim]`
    and their naive cache entries."""
    layer = jnnx.MLAAttention(c, rngs=nnx.Rngs(seed))
    table, num_blocks = jnnx.make_block_table(b, 48, c.page_size, seed=0)
    cache = jnnx.init_layer_cache(c, num_blocks, b)
    xs = np.asarray(jax.random.normal(jax.random.key(seed + 3), (b, steps, c.dim)), np.float32)
    return layer, cache, table, xs, _naive_entries(layer, xs, c)


@pytest.mark.parametrize("cfg", [dict(fmt="V32", index_topk=32, attn_sink=True),
                                 dict(fmt="MODEL1", index_topk=16, window=6, attn_sink=True)],
                         ids=["V32-sink", "MODEL1-sink-window"])
def test_layer_equals_independent_naive_mla(cfg):
    """Decoding token by token through the FP8 cache (context below top-k + window) equals a
    cache-free float64 MLA that shares no code with the layer but its weights and the FP8
    rounding: catches RoPE on wrong dims or positions, a dropped norm, wrong absorption."""
    c = jnnx.MLAConfig(**SMALL, **cfg)
    b, steps = 3, 16
    layer, cache, table, xs, entries = _layer_and_history(c, b, steps, seed=0)
    for t in range(steps):
        y, cache = _jit_step(layer, jnp.asarray(xs[:, t:t + 1]), cache, jnp.full((b,), t, jnp.int32), table, False)
        _assert_close(y[:, 0], _naive_mla(layer, xs, entries, t, c), rel=1e-2)


@pytest.mark.parametrize("indexer", jnnx.INDEXERS)
def test_beyond_topk_attends_the_indexers_best_tokens(indexer):
    """With more context than top-k, the layer equals naive MLA over the k positions the
    indexer scores highest (its own scores, ranked here independently)."""
    c = jnnx.MLAConfig(**SMALL, fmt="V32", index_topk=5, attn_sink=False, indexer=indexer)
    b, steps = 2, 12
    layer, cache, table, xs, entries = _layer_and_history(c, b, steps, seed=1)
    max_context = table.shape[1] * c.page_size
    for t in range(steps):
        x = jnp.asarray(xs[:, t:t + 1])
        pos = jnp.full((b, 1), t, jnp.int32)
        y, cache = _jit_step(layer, x, cache, pos[:, 0], table, False)
        qr = layer.q_norm(layer.wq_a(x))
        scores = np.asarray(layer._index_scores(x, qr, pos, cache, table, max_context))[:, 0, : t + 1]
        best = np.argsort(-scores, axis=-1, kind="stable")[:, : c.index_topk]
        keep = np.zeros((b, t + 1), bool)
        np.put_along_axis(keep, best, True, axis=-1)
        _assert_close(y[:, 0], _naive_mla(layer, xs, entries, t, c, keep), rel=1e-2)

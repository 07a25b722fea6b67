"""A DeepSeek-V3.2-style MLA attention layer for decoding, in Flax NNX, on `sparse_mla_decode`.

Per new token (any number `s` of tokens per request per call: 1 for plain decode, more for
MTP or chunked prefill):

* queries: q LoRA (`wq_a`, RMSNorm, `wq_b`) into per-head NoPE and RoPE parts;
* keys: `wkv_a` compresses the hidden state to the latent (512 dims for V32, 448 for MODEL1,
  RMSNormed) plus 64 RoPE dims shared by all heads; the latent and the rotated RoPE part are
  the token's cache entry, quantized into the paged FP8 cache with `write_kv`;
* weight absorption: the NoPE query is multiplied into the latent space by the key
  up-projection (`w_uk`), so attention runs over the cache entries directly; the attention
  output (512 dims: the latent for V32, latent + RoPE for MODEL1) is projected per head by
  `w_uv` and then by `wo`;
* the lightning indexer scores every cached token of the request (ReLU'd dot products of a
  few indexer heads, weighted per head) and keeps the top-k (pure JAX);
* options: the MODEL1 format (`fmt="MODEL1"`, d_qk 512), a per-head attention sink, and a
  sliding window kept in the op's extra cache (the window's tokens are then left out of the
  top-k so no token counts twice).

`dense=True` runs the same layer with naive dense MLA attention in float32 (keys and values
up-projected per head from the dequantized cache, every cached position attended): the
reference the sparse path equals while the context is shorter than top-k.

Tensor parallelism: the per-head weights carry sharding names (`tp_axis`, default "tp") on
their head dim (`nnx.get_partition_spec` turns them into PartitionSpecs); with the heads so
split the op's partitioning rule runs each device's heads locally on the replicated cache.

RoPE uses the rotate-halves layout in both attention and the indexer, with the YaRN scaling of
DeepSeek's configs when `rope_scaling` is set (`jax_sparse_mla.serving.yarn`). DeepSeek V3.2's own
attention RoPE is interleaved: `jax_sparse_mla.serving.checkpoint` permutes a checkpoint's RoPE rows
on load.

Indexer numerics (`indexer=`): "fp8" (default) is DeepSeek V3.2's: queries and keys rotated by a
Hadamard transform and quantized to FP8 with one scale per vector, keys kept in an FP8 paged
index cache (`jax_sparse_mla.serving.indexer`); "exact" scores float32 queries against bf16 keys,
unrotated.

Positions past the block table's capacity are neither written nor attended (their slot is -1):
size the table for the longest request.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_mla.op import _checks
from jax_sparse_mla.serving import indexer as fp8_indexer
from jax_sparse_mla.formats import D_V, KVFormat, dequantize_kv, write_kv
from jax_sparse_mla.op.decode import sparse_mla_decode
from jax_sparse_mla.serving.yarn import YarnScaling, rope_frequencies

__all__ = ["INDEXERS", "LayerCache", "MLAConfig", "MLAAttention", "init_layer_cache", "make_block_table", "rope",
           "token_slots", "window_indices"]

#: The indexer numerics `MLAConfig.indexer` selects.
INDEXERS = ("fp8", "exact")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Sizes of one attention layer (defaults: a small DeepSeek-V3.2 shape)."""

    dim: int = 256  # hidden size
    n_heads: int = 16
    q_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 64
    fmt: str = "V32"  # cache format: "V32" (d_qk 576) or "MODEL1" (d_qk 512)
    attn_sink: bool = False
    window: int = 0  # > 0: the last `window` tokens go to a sliding-window extra cache
    page_size: int = 64
    rope_theta: float = 10000.0
    # YaRN as in DeepSeek's config.json (a dict of it is accepted); None: plain RoPE.
    rope_scaling: YarnScaling | None = None
    indexer: str = "fp8"  # "fp8": DeepSeek's Hadamard + FP8 indexer; "exact": float32 / bf16
    index_scale_fmt: str | None = "ue8m0"  # FP8 indexer scales: powers of two, or None: float
    tp_axis: str = "tp"
    # Each request's attention independent of its batch-mates (sparse_mla_decode's batch_invariant).
    batch_invariant: bool = False

    def __post_init__(self):
        _checks.check_static_bool("MLAConfig.batch_invariant", self.batch_invariant)
        object.__setattr__(self, "rope_scaling", YarnScaling.from_config(self.rope_scaling))
        if self.indexer not in INDEXERS:
            raise ValueError(f"MLAConfig.indexer must be one of {INDEXERS}, got {self.indexer!r}")
        if self.index_scale_fmt not in fp8_indexer.SCALE_FMTS:
            raise ValueError(f"MLAConfig.index_scale_fmt must be one of {fp8_indexer.SCALE_FMTS}, "
                             f"got {self.index_scale_fmt!r}")
        d = self.index_head_dim
        if self.indexer == "fp8" and (d < 1 or d & (d - 1)):
            raise ValueError(f"MLAConfig.index_head_dim must be a power of two for the Hadamard transform of "
                             f"indexer='fp8', got {d}")

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat.coerce(self.fmt)

    @property
    def rope_dim(self) -> int:
        return self.kv_format.d_rope

    @property
    def latent_dim(self) -> int:
        return self.kv_format.d_nope

    @property
    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.rope_dim) ** -0.5
        return scale * (self.rope_scaling.softmax_factor if self.rope_scaling else 1.0)

    @property
    def index_rope_dim(self) -> int:
        """The indexer's leading dims that RoPE rotates (the rest of its head is position-free)."""
        return min(self.rope_dim, self.index_head_dim // 2)

    @property
    def window_capacity(self) -> int:
        """Tokens per request in the window ring (twice the window: one call may add up to
        `window + 1` tokens without overwriting a token a row still needs)."""
        return 2 * self.window


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    """One layer's decode state: the paged FP8 latent cache, the indexer's key cache on the same
    pages (FP8 codes and their scales for `indexer="fp8"`, bf16 keys and no scales for
    "exact") and the sliding-window ring (one page of `window_capacity` tokens per request;
    None without a window)."""

    kv: jax.Array  # [num_blocks, page_size, bytes_per_token] uint8
    index_k: jax.Array  # [num_blocks, page_size, index_head_dim] float8_e4m3fn ("fp8") or bf16 ("exact")
    window_kv: jax.Array | None = None  # [batch, window_capacity, bytes_per_token] uint8
    index_k_scale: jax.Array | None = None  # [num_blocks, page_size] float32 ("fp8")


def init_layer_cache(config: MLAConfig, num_blocks: int, batch: int) -> LayerCache:
    fmt = config.kv_format
    window = None
    if config.window:
        window = jnp.zeros((batch, config.window_capacity, fmt.bytes_per_token), jnp.uint8)
    pages = (num_blocks, config.page_size)
    fp8 = config.indexer == "fp8"
    return LayerCache(
        kv=jnp.zeros((*pages, fmt.bytes_per_token), jnp.uint8),
        index_k=jnp.zeros((*pages, config.index_head_dim), jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
        window_kv=window,
        index_k_scale=jnp.zeros(pages, jnp.float32) if fp8 else None,
    )


def make_block_table(batch: int, max_context: int, page_size: int, *, seed: int | None = 0):
    """A block table `[batch, pages_per_request]` over a pool of `batch * pages_per_request`
    pages (shuffled with `seed`, None keeps them in order). Returns (table, num_blocks)."""
    pages = -(-max_context // page_size)
    order = np.arange(batch * pages, dtype=np.int32)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(order).astype(np.int32)
    return jnp.asarray(order.reshape(batch, pages)), batch * pages


def rope(x, positions, theta: float = 10000.0, scaling: YarnScaling | None = None):
    """Rotary embedding of `x [..., s, (heads,) d]` (halves rotated) at `positions [..., s]`,
    YaRN-scaled when `scaling` is given."""
    d = x.shape[-1]
    freqs = jnp.asarray(rope_frequencies(d, theta, scaling), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [..., s, d/2]
    if x.ndim == positions.ndim + 2:  # a heads dim between s and d
        angles = angles[..., None, :]
    amplitude = scaling.rope_amplitude if scaling else 1.0
    cos, sin = jnp.cos(angles) * amplitude, jnp.sin(angles) * amplitude
    x1, x2 = x[..., : d // 2].astype(jnp.float32), x[..., d // 2:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _eager() -> bool:
    """Shard parameters at creation only under a mesh (`jax.set_mesh`); otherwise they carry
    their sharding names for `nnx.get_partition_spec` and are placed later."""
    return nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty


def _init(sharding):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding, eager_sharding=_eager())


class MLAAttention(nnx.Module):
    """The attention layer; call it as `layer(x, cache, positions, block_table)`."""

    def __init__(self, config: MLAConfig, *, rngs: nnx.Rngs):
        c = config
        tp = c.tp_axis
        self.config = c
        h, nope, rope_d, lat = c.n_heads, c.qk_nope_head_dim, c.rope_dim, c.latent_dim
        self.wq_a = nnx.Linear(c.dim, c.q_lora_rank, use_bias=False, kernel_init=_init((None, None)), rngs=rngs)
        self.q_norm = nnx.RMSNorm(c.q_lora_rank, rngs=rngs)
        self.wq_b = nnx.Linear(c.q_lora_rank, h * (nope + rope_d), use_bias=False, kernel_init=_init((None, tp)),
                               rngs=rngs)
        self.wkv_a = nnx.Linear(c.dim, lat + rope_d, use_bias=False, kernel_init=_init((None, None)), rngs=rngs)
        self.kv_norm = nnx.RMSNorm(lat, rngs=rngs)
        key_uk, key_uv = rngs.params(), rngs.params()
        # Up-projections of the latent: keys (NoPE part) and values, per head.
        self.w_uk = nnx.Param(jax.random.normal(key_uk, (h, nope, lat), jnp.float32) * lat ** -0.5,
                              out_sharding=(tp, None, None), eager_sharding=_eager())
        self.w_uv = nnx.Param(jax.random.normal(key_uv, (h, D_V, c.v_head_dim), jnp.float32) * D_V ** -0.5,
                              out_sharding=(tp, None, None), eager_sharding=_eager())
        self.wo = nnx.Linear(h * c.v_head_dim, c.dim, use_bias=False, kernel_init=_init((tp, None)), rngs=rngs)
        self.sink = nnx.data(None)
        if c.attn_sink:
            self.sink = nnx.Param(jax.random.normal(rngs.params(), (h,), jnp.float32), out_sharding=(tp,),
                                  eager_sharding=_eager())
        # Lightning indexer (replicated: a few small heads).
        self.wq_idx = nnx.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, use_bias=False,
                                 kernel_init=_init((None, None)), rngs=rngs)
        self.wk_idx = nnx.Linear(c.dim, c.index_head_dim, use_bias=False, kernel_init=_init((None, None)),
                                 rngs=rngs)
        self.k_idx_norm = nnx.LayerNorm(c.index_head_dim, rngs=rngs)
        self.w_idx_weights = nnx.Linear(c.dim, c.index_n_heads, use_bias=False, kernel_init=_init((None, None)),
                                        rngs=rngs)

    # -- pieces --------------------------------------------------------------------------------

    def _rope(self, x, pos):
        c = self.config
        return rope(x, pos, c.rope_theta, c.rope_scaling)

    def _queries(self, x, pos):
        """NoPE `[b, s, h, nope]` and rotated RoPE `[b, s, h, 64]` queries (float32) and the
        q LoRA latent (the indexer's input)."""
        c = self.config
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(*x.shape[:2], c.n_heads, c.qk_nope_head_dim + c.rope_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        return q_nope, self._rope(q_pe, pos), qr

    def _new_keys(self, x, pos):
        """The cache entries `[b, s, d_qk]` (bf16) of the new tokens: normed latent, rotated RoPE."""
        c = self.config
        kv = self.wkv_a(x)
        latent = self.kv_norm(kv[..., : c.latent_dim])
        k_pe = self._rope(kv[..., c.latent_dim:], pos)
        return jnp.concatenate([latent, k_pe], axis=-1).astype(jnp.bfloat16)

    def _index_rope(self, v, pos):
        """RoPE on the indexer's leading dims (halves layout, as DeepSeek's indexer); with
        `indexer="fp8"` then the Hadamard rotation."""
        r = self.config.index_rope_dim
        v = jnp.concatenate([self._rope(v[..., :r], pos), v[..., r:].astype(jnp.float32)], axis=-1)
        return fp8_indexer.hadamard(v) if self.config.indexer == "fp8" else v

    def _write_index_keys(self, x, pos, cache: LayerCache, slots):
        """The indexer keys of the new tokens stored at their slots: `(index_k, index_k_scale)`."""
        c = self.config
        k = self._index_rope(self.k_idx_norm(self.wk_idx(x)), pos)
        if c.indexer == "fp8":
            return fp8_indexer.write_index_k(cache.index_k, cache.index_k_scale, k, slots, c.index_scale_fmt)
        flat = cache.index_k.reshape(-1, c.index_head_dim)
        index_slots = jnp.where(slots < 0, flat.shape[0], slots)  # dropped, not wrapped
        flat = flat.at[index_slots].set(k.astype(jnp.bfloat16), mode="drop")
        return flat.reshape(cache.index_k.shape), None

    def _index_scores(self, x, qr, pos, cache: LayerCache, block_table, max_context):
        """Indexer scores `[b, s, max_context]` of every context position (-inf where masked),
        against the index keys in `cache`."""
        c = self.config
        b, s = x.shape[:2]
        q = self._index_rope(self.wq_idx(qr).reshape(b, s, c.index_n_heads, c.index_head_dim), pos)
        weights = self.w_idx_weights(x) * c.index_n_heads ** -0.5  # [b, s, heads]
        ctx = jnp.arange(max_context, dtype=jnp.int32)
        ctx_slots = token_slots(block_table, ctx[None, :], c.page_size)
        keys = cache.index_k.reshape(-1, c.index_head_dim)[ctx_slots]  # [b, t, d]
        if c.indexer == "fp8":
            q_codes, q_scale = fp8_indexer.quantize_fp8(q, c.index_scale_fmt)
            k_scale = cache.index_k_scale.reshape(-1)[ctx_slots]
            scores = fp8_indexer.index_scores(q_codes, weights * q_scale * c.index_head_dim ** -0.5, keys, k_scale)
        else:
            logits = jnp.einsum("bshd,btd->bsht", q, keys.astype(jnp.float32)) * c.index_head_dim ** -0.5
            scores = jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), weights)
        last = pos - (c.window if c.window else 0)  # the window's tokens are attended anyway
        return jnp.where(ctx[None, None, :] <= last[..., None], scores, -jnp.inf)

    # -- the layer ------------------------------------------------------------------------------

    def __call__(self, x, cache: LayerCache, positions, block_table, *, dense: bool = False,
                 return_topk: bool = False):
        """`x [b, s, dim]` hidden states of new tokens at positions `positions[i] + [0, s)`
        (`positions [b]` int32: the tokens already cached); `block_table [b, pages]`.
        Returns `(y [b, s, dim] float32, updated cache)`, and with `return_topk` also the
        context positions each new token attends to, `[b, s, k]` int32 best first, -1 past the
        valid ones (sparse path only). The cache's context capacity is `pages * page_size`
        tokens."""
        c = self.config
        fmt = c.kv_format
        b, s, _ = x.shape
        if c.window and s > c.window + 1:
            raise ValueError(f"x: at most window + 1 = {c.window + 1} new tokens per call with a window, got {s}")
        if dense and return_topk:
            raise ValueError("return_topk: the dense path selects no tokens (use dense=False)")
        pos = positions[:, None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)  # [b, s]
        max_context = block_table.shape[1] * c.page_size
        slots = token_slots(block_table, pos, c.page_size)

        q_nope, q_pe, qr = self._queries(x, pos)
        k_new = self._new_keys(x, pos)
        kv = write_kv(cache.kv, k_new, slots, fmt)
        index_k, index_k_scale = self._write_index_keys(x, pos, cache, slots)
        window_kv = cache.window_kv
        if c.window:
            ring = jnp.arange(b, dtype=jnp.int32)[:, None] * c.window_capacity + pos % c.window_capacity
            window_kv = write_kv(window_kv, k_new, ring, fmt)
        new_cache = LayerCache(kv=kv, index_k=index_k, window_kv=window_kv, index_k_scale=index_k_scale)

        if dense:
            o = self._dense_attention(q_nope, q_pe, kv, block_table, pos, max_context)
        else:
            scores = self._index_scores(x, qr, pos, new_cache, block_table, max_context)
            k = min(c.index_topk, max_context)
            top, chosen = jax.lax.top_k(scores, k)  # [b, s, k], best first
            chosen = jnp.where(jnp.isfinite(top), chosen, -1).astype(jnp.int32)
            context_slots = token_slots(block_table, jnp.arange(max_context, dtype=jnp.int32)[None], c.page_size)
            chosen_slots = context_slots[jnp.arange(b)[:, None, None], chosen]
            indices = jnp.where(chosen >= 0, chosen_slots, -1).astype(jnp.int32)
            # Valid entries come first; the longest row bounds the work (shorter rows hold -1s).
            topk_length = jnp.clip(pos[:, -1] + 1 - c.window, 0, k).astype(jnp.int32)
            # Weight absorption: NoPE queries into the latent space.
            q_lat = jnp.einsum("bshn,hnc->bshc", q_nope, self.w_uk[...])
            q = jnp.concatenate([q_lat, q_pe], axis=-1).astype(jnp.bfloat16)
            extra = {}
            if c.window:
                extra = dict(extra_kv_cache=window_kv, extra_indices=window_indices(c, pos))
            o, _ = sparse_mla_decode(q, kv, indices, sm_scale=c.softmax_scale, topk_length=topk_length,
                                     attn_sink=None if self.sink is None else self.sink[...],
                                     batch_invariant=c.batch_invariant, **extra)
            o = o.astype(jnp.float32)
        o = jnp.einsum("bshc,hcv->bshv", o, self.w_uv[...])
        y = self.wo(o.reshape(b, s, c.n_heads * c.v_head_dim))
        return (y, new_cache, chosen) if return_topk else (y, new_cache)

    def _dense_attention(self, q_nope, q_pe, kv, block_table, pos, max_context):
        """Naive MLA in float32: per-head keys and values up-projected from the dequantized
        latents of every cached position `<=` the row's position. Returns `[b, s, h, 512]`
        (the attention output in the value's latent space, before `w_uv`)."""
        c = self.config
        entries = dequantize_kv(kv, c.kv_format).astype(jnp.float32).reshape(-1, c.kv_format.d_qk)
        ctx = jnp.arange(max_context, dtype=jnp.int32)
        k = entries[token_slots(block_table, ctx[None, :], c.page_size)]  # [b, t, d_qk]
        latent, k_pe = k[..., : c.latent_dim], k[..., c.latent_dim:]
        k_nope = jnp.einsum("btc,hnc->bthn", latent, self.w_uk[...])
        values = k[..., :D_V]  # V32: the latent; MODEL1: latent + RoPE dims
        logits = (jnp.einsum("bshn,bthn->bsht", q_nope, k_nope)
                  + jnp.einsum("bshr,btr->bsht", q_pe, k_pe)) * c.softmax_scale
        logits = jnp.where(ctx[None, None, None, :] <= pos[:, :, None, None], logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - lse)
        if self.sink is not None:
            p = p * jax.nn.sigmoid(lse - self.sink[...][None, None, :, None])
        return jnp.einsum("bsht,btc->bshc", p, values)


def token_slots(block_table, pos, page_size: int):
    """Cache token slots of positions `pos [b, n]`: `page * page_size + offset`; -1 for a
    position past the block table (nothing is written there, nothing read)."""
    pages = block_table.shape[1]
    page_index = pos // page_size
    page = jnp.take_along_axis(block_table, jnp.clip(page_index, 0, pages - 1), axis=1)
    return jnp.where((page_index >= 0) & (page_index < pages), page * page_size + pos % page_size, -1)


def window_indices(config: MLAConfig, pos):
    """Window-cache slots `[b, s, window]` of each row's last `window` positions (-1 before 0):
    the extra list the layer attends besides its top-k."""
    b = pos.shape[0]
    p = pos[..., None] - jnp.arange(config.window, dtype=jnp.int32)  # [b, s, window]
    slot = jnp.arange(b, dtype=jnp.int32)[:, None, None] * config.window_capacity + p % config.window_capacity
    return jnp.where(p >= 0, slot, -1)

"""A small random-weight DeepSeek-style decoder for the demo: token embedding, `n_layers`
pre-norm blocks (the MLA sparse-attention layer of `jax_sparse_mla.nnx` and a SwiGLU MLP),
final norm and LM head. It decodes from paged FP8 caches, one `LayerCache` per layer, all
layers sharing one block table."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_sparse_mla.serving.nnx import LayerCache, MLAAttention, MLAConfig, _eager, init_layer_cache, make_block_table

__all__ = ["DecoderModel", "ModelConfig", "init_caches"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 1024
    n_layers: int = 2
    ffn_dim: int = 512
    attention: MLAConfig = MLAConfig()


def _init(sharding):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding, eager_sharding=_eager())


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dim, tp = config.attention.dim, config.attention.tp_axis
        self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = MLAAttention(config.attention, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.w_gate = nnx.Linear(dim, config.ffn_dim, use_bias=False, kernel_init=_init((None, tp)), rngs=rngs)
        self.w_up = nnx.Linear(dim, config.ffn_dim, use_bias=False, kernel_init=_init((None, tp)), rngs=rngs)
        self.w_down = nnx.Linear(config.ffn_dim, dim, use_bias=False, kernel_init=_init((tp, None)), rngs=rngs)

    def __call__(self, h, cache, positions, block_table, dense):
        a, cache = self.attn(self.attn_norm(h), cache, positions, block_table, dense=dense)
        h = h + a
        g = self.ffn_norm(h)
        return h + self.w_down(jax.nn.silu(self.w_gate(g)) * self.w_up(g)), cache


class DecoderModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dim = config.attention.dim
        self.embed = nnx.Embed(config.vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, config.vocab, use_bias=False, kernel_init=_init((None, None)), rngs=rngs)

    def __call__(self, tokens, caches: list[LayerCache], positions, block_table, *, dense: bool = False):
        """`tokens [b, s]` at positions `positions[i] + [0, s)`. Returns (logits `[b, s, vocab]`
        float32, updated caches). `dense=True`: naive float32 dense attention (reference)."""
        h = self.embed(tokens).astype(jnp.float32)
        new_caches = []
        for block, cache in zip(self.blocks, caches):
            h, cache = block(h, cache, positions, block_table, dense)
            new_caches.append(cache)
        return self.head(self.norm(h)), new_caches


def init_caches(config: ModelConfig, batch: int, max_context: int, *, seed: int | None = 0):
    """Empty caches for every layer and a (shuffled) block table with room for
    `max_context` tokens per request. Returns (caches, block_table)."""
    table, num_blocks = make_block_table(batch, max_context, config.attention.page_size, seed=seed)
    caches = [init_layer_cache(config.attention, num_blocks, batch) for _ in range(config.n_layers)]
    return caches, table

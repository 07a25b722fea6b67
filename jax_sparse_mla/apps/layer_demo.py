"""`python -m jax_sparse_mla layer`: load one DeepSeek-V3.2 attention layer from a checkpoint
and decode with it.

Without `--checkpoint` a synthetic checkpoint is written first (random DeepSeek-V3.2-shaped
weights in the Hugging Face layout: FP8 projections with 128 x 128 block scales, interleaved
RoPE rows, DeepSeek V3.2's YaRN `rope_scaling` in `config.json`), into `--write DIR` or a
temporary directory. The layer is loaded with `jax_sparse_mla.serving.checkpoint.load_deepseek_layer`,
fed a prompt of `--context` random hidden states in one call, then `--steps` single-token
decode steps. The same weights with the exact indexer (`indexer="exact"`) run alongside: the
report shows how many of the FP8 indexer's top-k tokens the exact one also picks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from jax_sparse_mla.apps.demo import _at_least


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_sparse_mla layer",
        description="Load a DeepSeek-V3.2 attention layer (synthetic weights unless --checkpoint) into the NNX "
                    "layer and decode with it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="a DeepSeek-V3.2 checkpoint directory (config.json + "
                                                   "*.safetensors); default: write a synthetic one")
    p.add_argument("--write", type=Path, help="where to write the synthetic checkpoint (default: a temporary "
                                              "directory, removed afterwards)")
    p.add_argument("--layer", type=_at_least(0), default=0, help="which attention layer to load")
    p.add_argument("--batch", type=_at_least(1), default=2, help="requests")
    p.add_argument("--context", type=_at_least(1), default=255, help="prompt tokens per request (one call)")
    p.add_argument("--steps", type=_at_least(1), default=4, help="decode steps after the prompt")
    p.add_argument("--page-size", type=_at_least(1), default=64, help="tokens per cache page")
    p.add_argument("--dim", type=_at_least(1), default=512, help="hidden size of the synthetic checkpoint")
    p.add_argument("--heads", type=_at_least(1), default=16, help="attention heads of the synthetic checkpoint")
    p.add_argument("--topk", type=_at_least(1), default=64, help="index top-k of the synthetic checkpoint")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights and hidden states seed")
    return p


def _synthetic(args, directory: Path) -> None:
    from jax_sparse_mla.serving import checkpoint
    from jax_sparse_mla.serving.nnx import MLAConfig

    config = MLAConfig(dim=args.dim, n_heads=args.heads, q_lora_rank=256, qk_nope_head_dim=128, v_head_dim=128,
                       index_n_heads=16, index_head_dim=128, index_topk=args.topk,
                       rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    tensors = checkpoint.random_layer_tensors(config, args.layer, seed=args.seed)
    checkpoint.write_checkpoint(directory, config, tensors)


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jax_sparse_mla.serving import checkpoint
    from jax_sparse_mla.serving.nnx import init_layer_cache, make_block_table
    from jax_sparse_mla.serving.yarn import rope_frequencies

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.checkpoint
        if directory is None:
            directory = args.write or Path(tmp)
            _synthetic(args, directory)
        start = time.perf_counter()
        layer = checkpoint.load_deepseek_layer(directory, args.layer, page_size=args.page_size)
        load_s = time.perf_counter() - start
        exact = checkpoint.load_deepseek_layer(directory, args.layer, page_size=args.page_size, indexer="exact")
        tensors = checkpoint.open_checkpoint(directory)
        fp8 = sum(1 for name in tensors if name.endswith(("weight_scale_inv", ".scale")))
    c = layer.config
    b, total = args.batch, args.context + args.steps
    table, num_blocks = make_block_table(b, total, c.page_size, seed=args.seed)
    xs = jax.random.normal(jax.random.key(args.seed + 1), (b, total, c.dim), jnp.float32)

    outputs, tops, step_s = {}, {}, []
    for name, module in (("fp8", layer), ("exact", exact)):
        graphdef, state = nnx.split(module)
        # The cache is donated: each call writes its tokens in place.
        step = jax.jit(lambda state, x, cache, pos, graphdef=graphdef: nnx.merge(graphdef, state)(
            x, cache, pos, table, return_topk=True), donate_argnums=(2,))
        cache = init_layer_cache(module.config, num_blocks, b)
        y, cache, top = step(state, xs[:, : args.context], cache, jnp.zeros((b,), jnp.int32))
        ys, ts = [y], [top]
        for t in range(args.context, total):
            start = time.perf_counter()
            y, cache, top = step(state, xs[:, t:t + 1], cache, jnp.full((b,), t, jnp.int32))
            jax.block_until_ready(y)
            if name == "fp8" and t > args.context:  # the first decode step compiles
                step_s.append(time.perf_counter() - start)
            ys.append(y)
            ts.append(top)
        outputs[name], tops[name] = np.concatenate(ys, 1), np.concatenate(ts, 1)

    k = tops["fp8"].shape[-1]
    decode = slice(args.context, total)
    overlap = [len(set(a[a >= 0]) & set(e[e >= 0])) / max(int((a >= 0).sum()), 1)
               for a, e in zip(tops["fp8"][:, decode].reshape(-1, k), tops["exact"][:, decode].reshape(-1, k))]
    y, y_exact = outputs["fp8"][:, decode], outputs["exact"][:, decode]
    scaling = c.rope_scaling
    changed = 0 if scaling is None else int(np.sum(~np.isclose(rope_frequencies(c.rope_dim, c.rope_theta, scaling),
                                                               rope_frequencies(c.rope_dim, c.rope_theta))))
    return dict(
        checkpoint=str(args.checkpoint or args.write or "synthetic (temporary)"), tensors=len(tensors),
        fp8_tensors=fp8, load_s=load_s, heads=c.n_heads, dim=c.dim, topk=c.index_topk,
        yarn_factor=None if scaling is None else scaling.factor, rope_freqs_changed=changed,
        softmax_factor=1.0 if scaling is None else scaling.softmax_factor,
        finite=bool(np.isfinite(outputs["fp8"]).all()),
        decode_ms=1e3 * float(np.mean(step_s)) if step_s else float("nan"),
        topk_overlap_exact=float(np.mean(overlap)),
        rel_diff_exact=float(np.max(np.abs(y - y_exact)) / np.max(np.abs(y_exact))))


def report(stats: dict) -> None:
    yarn = ("off" if stats["yarn_factor"] is None else
            f"factor {stats['yarn_factor']:g}: {stats['rope_freqs_changed']} RoPE frequencies scaled, softmax "
            f"scale x{stats['softmax_factor']:.3f}")
    lines = [
        ("checkpoint", stats["checkpoint"]),
        ("tensors read", f"{stats['tensors']} ({stats['fp8_tensors']} FP8 with block scales), "
                         f"loaded in {stats['load_s']:.2f} s"),
        ("layer", f"dim {stats['dim']}, {stats['heads']} heads, index top-k {stats['topk']}"),
        ("YaRN", yarn),
        ("decode step", f"{stats['decode_ms']:.2f} ms (outputs finite: {stats['finite']})"),
        ("top-k shared with exact indexer", f"{100 * stats['topk_overlap_exact']:.1f}%"),
        ("output vs exact indexer", f"max rel. difference {stats['rel_diff_exact']:.2e}"),
    ]
    for key, value in lines:
        print(f"{key:>32}: {value}")


def main(argv=None) -> int:
    report(run(build_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

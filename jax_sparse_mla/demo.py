"""`python -m jax_sparse_mla demo`: a small random-weight DeepSeek-style model decoding from
paged FP8 caches through a jitted, buffer-donating step, on the GPU if there is one, else the CPU.

The prompt (`--context` tokens) is fed through the same decode step one token at a time, then
`--steps` tokens are generated greedily. On the first `--check-steps` steps the logits are
compared with the same model run with naive float32 dense attention (equal while the context
is shorter than top-k). Prints tokens/s, the attention op's share of the step time and that
agreement.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"  # what argparse names in its error
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_sparse_mla demo",
        description="Decode with a small random-weight DeepSeek-style model (MLA + lightning indexer + "
                    "sparse FP8 attention) and report speed and agreement with dense attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=_at_least(1), default=2, help="decoder layers")
    p.add_argument("--heads", type=_at_least(1), default=16, help="attention heads (divisible by --tp)")
    p.add_argument("--batch", type=_at_least(1), default=4, help="requests decoded together")
    p.add_argument("--steps", type=_at_least(2), default=64, help="tokens generated per request after the prompt")
    p.add_argument("--context", type=_at_least(1), default=32, help="prompt tokens per request, fed before generating")
    p.add_argument("--tp", type=_at_least(1), default=1, help="tensor-parallel devices (heads and the MLP split; must "
                                                     "divide --heads and 512); on the CPU this many host "
                                                     "devices are created")
    p.add_argument("--topk", type=_at_least(1), default=64, help="tokens the indexer keeps per query")
    p.add_argument("--format", choices=("V32", "MODEL1"), default="V32", help="FP8 cache format")
    p.add_argument("--sink", action="store_true", help="per-head attention sink")
    p.add_argument("--window", type=_at_least(0), default=0, help="sliding window kept in the extra cache (0: off)")
    p.add_argument("--dim", type=_at_least(1), default=256, help="hidden size")
    p.add_argument("--vocab", type=_at_least(2), default=1024, help="vocabulary size")
    p.add_argument("--page-size", type=_at_least(1), default=64, help="tokens per cache page")
    p.add_argument("--check-steps", type=_at_least(0), default=4, help="first steps compared with dense attention "
                                                                 "(only while the context fits in --topk + --window, "
                                                                 "where the two must agree)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompt and page-shuffle seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _progress(total: int, enabled: bool):
    """A progress bar (rich, else tqdm) as (advance(), close()); no-ops when disabled."""
    if enabled:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           transient=True)
            task = bar.add_task("decode", total=total)
            bar.start()
            return (lambda: bar.advance(task)), bar.stop
        except ImportError:
            try:
                from tqdm import tqdm

                bar = tqdm(total=total, desc="decoding", leave=False)
                return (lambda: bar.update(1)), bar.close
            except ImportError:
                pass
    return (lambda: None), (lambda: None)


def _time(fn, *args, repeat: int = 10) -> float:
    """Seconds per call (after one warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeat


def _heads(hlo: str) -> int | None:
    """Heads per device of the op in a compiled program: from the decode call's `out` shape."""
    m = re.search(r"\(bf16\[\d+,\d+,(\d+),512\][^)]*\) custom-call\([^\n]*jsm_decode", hlo)
    return int(m.group(1)) if m else None


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_sparse_mla as jsm
    from jax_sparse_mla.model import DecoderModel, ModelConfig, init_caches
    from jax_sparse_mla.nnx import MLAConfig, token_slots, window_indices

    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    devices = jax.devices(platform)
    if args.tp < 1 or args.tp > len(devices):
        raise SystemExit(f"--tp {args.tp}: {len(devices)} {platform} device(s) available")
    if args.heads % args.tp or ModelConfig.ffn_dim % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide --heads ({args.heads}) and the MLP size ({ModelConfig.ffn_dim})")
    mesh = Mesh(np.asarray(devices[: args.tp]), ("tp",))
    replicated = NamedSharding(mesh, P())

    attn = MLAConfig(dim=args.dim, n_heads=args.heads, index_topk=args.topk, fmt=args.format,
                     attn_sink=args.sink, window=args.window, page_size=args.page_size)
    config = ModelConfig(vocab=args.vocab, n_layers=args.layers, attention=attn)
    b, total = args.batch, args.context + args.steps
    model = DecoderModel(config, rngs=nnx.Rngs(args.seed))
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    state = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), state, specs)
    caches, table = init_caches(config, b, total, seed=args.seed)
    caches, table = jax.device_put((caches, table), replicated)
    prompt = jax.device_put(
        jax.random.randint(jax.random.key(args.seed + 1), (b, args.context), 0, args.vocab), replicated)

    def forward(state, caches, tokens, positions, table, dense):
        logits, caches = nnx.merge(graphdef, state)(tokens[:, None], caches, positions, table, dense=dense)
        return logits[:, 0], caches

    tokens = prompt[:, 0]
    positions = jax.device_put(jnp.zeros((b,), jnp.int32), replicated)
    # The caches are donated: the step writes the new tokens in place.
    start = time.perf_counter()
    step = jax.jit(lambda *a: forward(*a, dense=False), donate_argnums=(1,)).lower(
        state, caches, tokens, positions, table).compile()
    compile_time = time.perf_counter() - start
    dense_step = jax.jit(lambda *a: forward(*a, dense=True)).lower(state, caches, tokens, positions, table).compile()

    feeds = args.context + args.steps - 1  # the last generated token is not fed back
    advance, close = _progress(feeds, not args.no_progress)
    errors, agree, gen_time, first_step, timed = [], [], 0.0, 0.0, 0
    generated = []
    try:
        for t in range(feeds):
            # Dense and sparse attention agree while every cached token is selected.
            check = t < args.check_steps and t + 1 <= args.topk + args.window
            if check:
                ref_logits, _ = dense_step(state, caches, tokens, positions, table)
                jax.block_until_ready(ref_logits)  # not inside the timed sparse step
            start = time.perf_counter()
            logits, caches = step(state, caches, tokens, positions, table)
            next_tokens = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
            next_tokens.block_until_ready()
            elapsed = time.perf_counter() - start
            if t == 0:
                first_step = elapsed
            elif t >= args.context:  # feeding a generated token
                gen_time += elapsed
                timed += 1
            if check:
                ref = np.asarray(ref_logits, np.float64)
                errors.append(float(np.max(np.abs(np.asarray(logits, np.float64) - ref)) / np.max(np.abs(ref))))
                agree.append(float(np.mean(np.argmax(ref, -1) == np.asarray(next_tokens))))
            positions = positions + 1
            if t + 1 < args.context:
                tokens = prompt[:, t + 1]
            else:
                tokens = next_tokens
                generated.append(np.asarray(next_tokens))
            advance()
    finally:
        close()
    step_time = gen_time / timed if timed else float("nan")

    # The attention op alone, called as the layers call it at the last fed position: the
    # layer's top-k size and lengths, its window extra list and sink, tokens of the request's own
    # earlier positions (random ones: the time does not depend on which).
    fmt = jsm.KVFormat.coerce(args.format)
    last = feeds - 1
    k = min(args.topk, table.shape[1] * args.page_size)
    n_valid = int(np.clip(last + 1 - args.window, 0, k))
    idx_rng = np.random.default_rng(args.seed)
    earlier = jnp.asarray(idx_rng.integers(0, max(last + 1 - args.window, 1), (b, k), dtype=np.int32))
    indices = jnp.where(jnp.arange(k) < n_valid, token_slots(table, earlier, args.page_size), -1)[:, None, :]
    op_args = dict(indices=indices.astype(jnp.int32), topk_length=jnp.full((b,), n_valid, jnp.int32))
    if args.window:
        op_args["extra_indices"] = window_indices(attn, jnp.full((b, 1), last, jnp.int32))
    if args.sink:
        op_args["attn_sink"] = jax.device_put(jnp.asarray(idx_rng.normal(size=args.heads), jnp.float32),
                                              NamedSharding(mesh, P("tp")))
    op_args = {key: jax.device_put(v, replicated) if key != "attn_sink" else v for key, v in op_args.items()}
    q = jax.device_put(jnp.asarray(idx_rng.normal(size=(b, 1, args.heads, fmt.d_qk)), jnp.bfloat16),
                       NamedSharding(mesh, P(None, None, "tp")))

    @jax.jit
    def attention_only(q, caches, op_args):
        return [jsm.sparse_mla_decode(q, c.kv, sm_scale=attn.softmax_scale,
                                      extra_kv_cache=c.window_kv if args.window else None, **op_args)[0]
                for c in caches]

    attn_time = _time(attention_only, q, caches, op_args)
    stats = dict(
        platform=platform, devices=args.tp, batch=b, layers=args.layers, heads=args.heads,
        cache=f"{fmt.name} FP8 paged, page {args.page_size}, top-k {args.topk}, "
              f"{args.context} + {args.steps} tokens per request",
        tokens_per_s=b / step_time, step_ms=step_time * 1e3,
        attention_ms=attn_time * 1e3, attention_share=attn_time / step_time,
        compile_s=compile_time, first_step_s=first_step, op_heads_per_device=_heads(step.as_text()),
        max_rel_logit_error=max(errors) if errors else float("nan"),
        argmax_agreement=float(np.mean(agree)) if agree else float("nan"), checked_steps=len(errors),
        generated=np.stack(generated, axis=1) if generated else np.zeros((b, 0), np.int32))
    return stats


def report(stats: dict) -> None:
    lines = [
        ("device", f"{stats['platform']} x{stats['devices']}"),
        ("model", f"{stats['layers']} layers, {stats['heads']} heads, batch {stats['batch']}"),
        ("cache", stats["cache"]),
        ("compile", f"{stats['compile_s']:.2f} s (first step {1e3 * stats['first_step_s']:.1f} ms)"),
        ("attention op heads per device", str(stats["op_heads_per_device"])),
        ("decode step", f"{stats['step_ms']:.2f} ms"),
        ("tokens/s", f"{stats['tokens_per_s']:.1f}"),
        ("attention op", f"{stats['attention_ms']:.3f} ms/step ({100 * stats['attention_share']:.1f}% of the step)"),
        (f"vs dense attention (first {stats['checked_steps']} steps)",
         f"max rel. logit error {stats['max_rel_logit_error']:.2e}, argmax agreement "
         f"{100 * stats['argmax_agreement']:.1f}%" if stats["checked_steps"] else "not checked"),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="jax_sparse_mla demo", show_header=False)
        for key, value in lines:
            table.add_row(key, value)
        Console().print(table)
    except ImportError:
        for key, value in lines:
            print(f"{key:>34}: {value}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp > 1:
        # Host devices for a CPU run; read when the CPU backend starts (harmless on a GPU).
        flag = "--xla_force_host_platform_device_count"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={args.tp}".strip()
    report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

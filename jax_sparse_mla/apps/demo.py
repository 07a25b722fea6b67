"""`python -m jax_sparse_mla demo`: a small random-weight DeepSeek-style model decoding from
paged FP8 caches through a jitted, buffer-donating step, on the GPU if there is one, else the CPU.

The prompt (`--context` tokens) is fed through the same decode step one token at a time, then
`--steps` tokens are generated greedily. On the first `--check-steps` steps the logits are
compared with the same model run with naive float32 dense attention (equal while the context
is shorter than top-k). Prints tokens/s, the attention op's share of the step time and that
agreement.

Several devices (`--dp M --tp N`, M x N devices): requests split M ways, heads (and the MLP
where it divides) N ways, under plain `jax.jit`. The caches stay replicated, the layout the op
partitions itself in without collectives; each device's op decodes its own requests and heads.
(Per-device cache pools would need `shard_map` over dp, inside which the op is not split over tp.)
`--vs-one-device` also runs the same model and global batch on one device and prints it beside.
"""

from __future__ import annotations

import argparse
import math
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
    p.add_argument("--tp", type=_at_least(1), default=1, help="tensor-parallel devices: the heads (and the MLP where "
                                                     "it divides) split over them; must divide --heads")
    p.add_argument("--dp", type=_at_least(1), default=1, help="data-parallel devices: the requests split over them; "
                                                     "must divide --batch. --dp x --tp devices are used (on the "
                                                     "CPU that many host devices are created)")
    p.add_argument("--vs-one-device", action="store_true", help="also run on one device at the same global batch "
                                                                "and print it beside (needs --dp x --tp > 1)")
    p.add_argument("--topk", type=_at_least(1), default=64, help="tokens the indexer keeps per query")
    p.add_argument("--format", choices=("V32", "MODEL1"), default="V32", help="FP8 cache format")
    p.add_argument("--sink", action="store_true", help="per-head attention sink")
    p.add_argument("--window", type=_at_least(0), default=0, help="sliding window kept in the extra cache (0: off)")
    p.add_argument("--batch-invariant", action="store_true", help="batch-invariant attention: each request's result "
                                                                  "independent of the other requests and the layout")
    p.add_argument("--dim", type=_at_least(1), default=256, help="hidden size")
    p.add_argument("--vocab", type=_at_least(2), default=1024, help="vocabulary size")
    p.add_argument("--page-size", type=_at_least(1), default=64, help="tokens per cache page")
    p.add_argument("--check-steps", type=_at_least(0), default=4, help="first steps compared with dense attention "
                                                                 "(only while the context fits in --topk + --window, "
                                                                 "where the two must agree)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompt and page-shuffle seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed flags, checked against each other (argparse's usage error names the flag)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.heads % args.tp:
        p.error(f"argument --tp: must divide --heads ({args.heads}), got {args.tp}")
    if args.batch % args.dp:
        p.error(f"argument --dp: must divide --batch ({args.batch}), got {args.dp}")
    if args.vs_one_device and args.dp * args.tp == 1:
        p.error("argument --vs-one-device: needs a multi-device run (--dp x --tp > 1), got --dp 1 --tp 1")
    return args


def _progress(total: int, enabled: bool, label: str = "decoding"):
    """A progress bar (rich, else tqdm) as (advance(), close()); no-ops when disabled."""
    if enabled:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           transient=True)
            task = bar.add_task("decode", total=total)
            bar.start()
            return (lambda: bar.advance(task)), bar.stop
        except ImportError:
            try:
                from tqdm import tqdm

                bar = tqdm(total=total, desc=label, leave=False)
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


def _op_shape(hlo: str) -> tuple[int | None, int | None]:
    """(requests, heads) per device of the op in a compiled program: from the decode call's
    `out` shape."""
    m = re.search(r"\(bf16\[(\d+),\d+,(\d+),512\][^)]*\) custom-call\([^\n]*jsm_decode", hlo)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def _rel_error(got, ref) -> float:
    """max |got - ref| / max |ref| (float64): how the demo compares logits."""
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def _fit(spec, shape, mesh):
    """`spec` without the mesh axes that do not divide their dim (that dim stays replicated):
    with --tp not dividing the MLP size the MLP is not split."""
    from jax.sharding import PartitionSpec as P

    entries = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        entries.append(entry if dim % math.prod(mesh.shape[a] for a in axes) == 0 else None)
    return P(*entries)


def run(args: argparse.Namespace) -> dict:
    """One decode run on --dp x --tp devices; returns its measurements."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_sparse_mla as jsm
    from jax_sparse_mla.serving import sharding
    from jax_sparse_mla.apps.model import DecoderModel, ModelConfig, init_caches
    from jax_sparse_mla.serving.nnx import MLAConfig, token_slots, window_indices

    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    devices = jax.devices(platform)
    n_dev = args.dp * args.tp
    if n_dev > len(devices):
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp}: needs {n_dev} {platform} devices, "
                         f"got {len(devices)}")
    mesh = Mesh(np.asarray(devices[:n_dev]).reshape(args.dp, args.tp), ("dp", "tp"))
    replicated = NamedSharding(mesh, P())
    per_request = NamedSharding(mesh, P("dp"))

    attn = MLAConfig(dim=args.dim, n_heads=args.heads, index_topk=args.topk, fmt=args.format,
                     attn_sink=args.sink, window=args.window, page_size=args.page_size,
                     batch_invariant=args.batch_invariant)
    config = ModelConfig(vocab=args.vocab, n_layers=args.layers, attention=attn)
    b, total = args.batch, args.context + args.steps
    model = DecoderModel(config, rngs=nnx.Rngs(args.seed))
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    state = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, _fit(s, v.shape, mesh))), state, specs)
    # Caches replicated (each device's op reads only its requests' pages); the per-request
    # inputs split over dp.
    caches, host_table = init_caches(config, b, total, seed=args.seed)
    caches = jax.device_put(caches, replicated)
    cache_shardings = jax.tree.map(lambda _: replicated, caches)
    table = jax.device_put(host_table, per_request)
    prompt = jax.device_put(
        jax.random.randint(jax.random.key(args.seed + 1), (b, args.context), 0, args.vocab), per_request)

    def forward(state, caches, tokens, positions, table, dense):
        logits, caches = nnx.merge(graphdef, state)(tokens[:, None], caches, positions, table, dense=dense)
        return logits[:, 0], caches

    tokens = prompt[:, 0]
    positions = jax.device_put(jnp.zeros((b,), jnp.int32), per_request)
    # The caches are donated: the step writes the new tokens in place (and keeps them replicated).
    out_shardings = (per_request, cache_shardings)
    start = time.perf_counter()
    step = jax.jit(lambda *a: forward(*a, dense=False), donate_argnums=(1,), out_shardings=out_shardings).lower(
        state, caches, tokens, positions, table).compile()
    compile_time = time.perf_counter() - start
    dense_step = jax.jit(lambda *a: forward(*a, dense=True), out_shardings=out_shardings).lower(
        state, caches, tokens, positions, table).compile()

    feeds = args.context + args.steps - 1  # the last generated token is not fed back
    label = "decoding" if n_dev == 1 else f"decoding on {n_dev} devices"
    advance, close = _progress(feeds, not args.no_progress, label)
    errors, agree, gen_time, first_step, timed = [], [], 0.0, 0.0, 0
    generated, prompt_logits = [], None
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
            if t == args.context - 1:  # the whole prompt fed: same inputs in every layout
                prompt_logits = np.asarray(logits, np.float32)
            if check:
                errors.append(_rel_error(logits, ref_logits))
                agree.append(float(np.mean(np.argmax(np.asarray(ref_logits), -1) == np.asarray(next_tokens))))
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
    indices = jnp.where(jnp.arange(k) < n_valid, token_slots(host_table, earlier, args.page_size), -1)[:, None, :]
    op_args = dict(q=jnp.asarray(idx_rng.normal(size=(b, 1, args.heads, fmt.d_qk)), jnp.bfloat16),
                   indices=indices.astype(jnp.int32), topk_length=jnp.full((b,), n_valid, jnp.int32))
    if args.window:
        op_args["extra_indices"] = window_indices(attn, jnp.full((b, 1), last, jnp.int32))
    if args.sink:
        op_args["attn_sink"] = jnp.asarray(idx_rng.normal(size=args.heads), jnp.float32)

    @jax.jit
    def attention_only(kv_caches, window_caches, op_args):
        return [jsm.sparse_mla_decode(kv_cache=kv, sm_scale=attn.softmax_scale, extra_kv_cache=window,
                                      batch_invariant=args.batch_invariant, **op_args)[0]
                for kv, window in zip(kv_caches, window_caches)]

    kv_caches = [c.kv for c in caches]
    window_caches = [c.window_kv for c in caches]
    placed = sharding.shard_decode_inputs(mesh, op_args, batch_axis="dp", head_axis="tp")
    attn_time = _time(attention_only, kv_caches, window_caches, placed)
    # One device's share: its requests and heads, timed alone on that device.
    b_dev, h_dev = b // args.dp, args.heads // args.tp
    local = {key: v[:h_dev] if key == "attn_sink" else v[:b_dev, :, :h_dev] if key == "q" else v[:b_dev]
             for key, v in op_args.items()}
    attn_dev_time = attn_time if n_dev == 1 else _time(
        attention_only, *jax.device_put((kv_caches, window_caches, local), devices[0]))

    hlo = step.as_text()
    op_requests, op_heads = _op_shape(hlo)
    stats = dict(
        platform=platform, devices=n_dev, dp=args.dp, tp=args.tp, batch=b, layers=args.layers, heads=args.heads,
        batch_invariant=args.batch_invariant,
        cache=f"{fmt.name} FP8 paged, page {args.page_size}, top-k {args.topk}, "
              f"{args.context} + {args.steps} tokens per request",
        tokens_per_s=b / step_time, step_ms=step_time * 1e3,
        attention_ms=attn_time * 1e3, attention_share=attn_time / step_time,
        attention_per_device_ms=attn_dev_time * 1e3,
        compile_s=compile_time, first_step_s=first_step,
        op_requests_per_device=op_requests, op_heads_per_device=op_heads, step_hlo=hlo,
        cache_shapes=[leaf.shape for leaf in jax.tree.leaves(caches)],
        max_rel_logit_error=max(errors) if errors else float("nan"),
        argmax_agreement=float(np.mean(agree)) if agree else float("nan"), checked_steps=len(errors),
        prompt_logits=prompt_logits,
        generated=np.stack(generated, axis=1) if generated else np.zeros((b, 0), np.int32))
    return stats


def measure(args: argparse.Namespace) -> list[dict]:
    """The run of `args`, then with --vs-one-device the same model and global batch on one
    device; the first run's stats then hold `max_rel_logit_diff_vs_one_device` (the logits after
    the whole prompt, the same inputs in both)."""
    runs = [run(args)]
    if args.vs_one_device:
        runs.append(run(argparse.Namespace(**{**vars(args), "dp": 1, "tp": 1})))
        runs[0]["max_rel_logit_diff_vs_one_device"] = _rel_error(runs[0]["prompt_logits"], runs[1]["prompt_logits"])
    return runs


def _rows(stats: dict) -> list[tuple[str, str]]:
    layout = f" (DP {stats['dp']} x TP {stats['tp']})" if stats["devices"] > 1 else ""
    return [
        ("device", f"{stats['platform']} x{stats['devices']}{layout}"),
        ("model", f"{stats['layers']} layers, {stats['heads']} heads, batch {stats['batch']}"),
        ("cache", stats["cache"]),
        ("compile", f"{stats['compile_s']:.2f} s (first step {1e3 * stats['first_step_s']:.1f} ms)"),
        ("attention op per device", f"{stats['op_requests_per_device']} requests x "
                                    f"{stats['op_heads_per_device']} heads"),
        ("decode step", f"{stats['step_ms']:.2f} ms"),
        ("tokens/s", f"{stats['tokens_per_s']:.1f}"),
        ("attention op", f"{stats['attention_ms']:.3f} ms/step ({100 * stats['attention_share']:.1f}% of the step)"
                         + (", batch-invariant" if stats["batch_invariant"] else "")),
        ("attention op, one device's share alone", f"{stats['attention_per_device_ms']:.3f} ms/step"),
        (f"vs dense attention (first {stats['checked_steps']} steps)",
         f"max rel. logit error {stats['max_rel_logit_error']:.2e}, argmax agreement "
         f"{100 * stats['argmax_agreement']:.1f}%" if stats["checked_steps"] else "not checked"),
    ]


def report(stats: dict, baseline: dict | None = None) -> None:
    """The run's table; with a one-device `baseline`, its column beside and the comparison."""
    rows = _rows(stats)
    if baseline is not None:
        rows = [(key, value, other) for (key, value), (_, other) in zip(rows, _rows(baseline))]
        rows.append(("step speedup vs one device", f"{baseline['step_ms'] / stats['step_ms']:.2f}x", ""))
        diff = stats["max_rel_logit_diff_vs_one_device"]
        rows.append(("vs one device (logits after the prompt)", f"max rel. difference {diff:.2e}", ""))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="jax_sparse_mla demo", show_header=baseline is not None)
        for column in ("", "this run", "one device")[: len(rows[0])]:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    except ImportError:
        print("jax_sparse_mla demo")
        for key, *values in rows:
            print(f"{key:>40}: " + " | ".join(values))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dp * args.tp > 1:
        # Host devices for a CPU run; read when the CPU backend starts (harmless on a GPU).
        flag = "--xla_force_host_platform_device_count"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={args.dp * args.tp}".strip()
    report(*measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

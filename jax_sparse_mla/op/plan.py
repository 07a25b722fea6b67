"""The split-KV plan: `plan_decode` (the `jsm_plan` FFI call) and the `DecodePlan` it returns.

A plan depends only on shapes and the length arrays, so one plan serves every layer of a decode
step (docs/schedule.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import _ints
from jax_sparse_mla.op import _checks, _ffi

HEADS_PER_CTA = 64
# More workers than this only adds empty partial-buffer rows ([b + num_parts, s_q, h_q, 512] f32).
MAX_NUM_PARTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static facts the schedule is sized from.

    `num_sms` bounds the worker count; on CUDA it is lowered to what the GPU
    actually has: by the plan handler at run time, or, for a plan without length
    arrays, while tracing, from GPU 0's SM count (`plan_decode`).
    132 is the H100/H200 SXM count; no Hopper part has more.
    """

    num_sms: int = 132


CPU_WORKERS = 8


@functools.cache
def default_config() -> DecodeConfig:
    """The config used when none is given, fixed once at first use from JAX's
    default backend. GPUs get 132 SMs (the CUDA handler fits it to the GPU). The
    CPU handler runs workers one after another, so a few keep the fp32 partial
    buffers `[b + workers, ...]` small while still exercising the combine pass."""
    return DecodeConfig(num_sms=132 if jax.default_backend() in ("gpu", "cuda") else CPU_WORKERS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A split-KV schedule. Depends only on shapes and the length arrays, so one
    plan serves every layer of a decode step. Its arrays are ordinary JAX
    values: compute it inside the jitted step (or pass it in)."""

    sched: jax.Array  # [num_parts, 8] int32, one row per worker (docs/schedule.md)
    num_splits: jax.Array  # [b + 1] int32, prefix sum of pieces per request
    batch: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(metadata=dict(static=True))
    extra_topk: int = dataclasses.field(metadata=dict(static=True))
    # Made by plan_decode(batch_invariant=True): one worker per fixed chunk of each request.
    batch_invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Known while tracing (plan_decode without length arrays, its worker count fixed then): no
    # request is cut into pieces, so the decode writes every out/lse row itself and
    # sparse_mla_decode runs no combine. A hand-made plan leaves it False.
    unsplit: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_parts(self) -> int:
        return int(self.sched.shape[0])


def default_num_parts(s_q: int, h_q: int, config: DecodeConfig | None = None) -> int:
    """FlashMLA's worker count: SMs / s_q / (head groups of 64), at least 1."""
    config = config or default_config()
    return max(config.num_sms // s_q // math.ceil(h_q / HEADS_PER_CTA), 1)


def plan_decode(
    q,
    indices,
    *,
    topk_length=None,
    extra_indices=None,
    extra_topk_length=None,
    num_parts: int | None = None,
    config: DecodeConfig | None = None,
    batch_invariant: bool = False,
) -> DecodePlan:
    """Plans the split-KV schedule of `sparse_mla_decode`.

    Only the shapes of `q` `[b, s_q, h_q, d_qk]`, `indices` `[b, s_q, topk]` and
    `extra_indices` `[b, s_q, extra_topk]` are used (arrays or
    `jax.ShapeDtypeStruct`s), plus the values of the optional `[b]` int32 length
    arrays. Pass the same lengths to `sparse_mla_decode`.

    `num_parts`: the number of workers. Default: `default_num_parts(s_q, h_q)`,
    fitted on CUDA to the SM count of the GPU that runs it (without length arrays:
    while tracing, to GPU 0's). An explicit value is used as is (useful to force
    many small pieces).

    Without length arrays the plan follows from the shapes, and `plan.unsplit` says
    while tracing whether it cuts no request into pieces; then every out/lse row is
    the decode pass's own and `sparse_mla_decode` skips the combine pass.

    `batch_invariant`: every request is cut into fixed chunks of its own blocks (32
    blocks, 2048 entries: a V3.2 top-k of 2048 is one chunk), each one piece, so its
    `out`/`lse` do not depend on the other requests, the batch size, `num_parts` or the
    sharding (README "Reproducibility"). Workers take whole chunks; two chunks of one
    request never share a worker, so at least `1 + b * (max_chunks - 1)` workers are
    needed (`max_chunks`: the chunks of a request of full `topk` + `extra_topk`). Default
    `num_parts`: the larger of that and `default_num_parts(s_q, h_q)` (not fitted to
    the device: the plan is the same everywhere, though the bits would not change).
    """
    _checks.check_static_bool("batch_invariant", batch_invariant)
    b, s_q, h_q, _ = _checks.check_q_shape(q)
    topk = _checks.check_ids_shape("indices", indices, b, s_q, "topk")
    extra_topk = 0
    if extra_indices is not None:
        extra_topk = _checks.check_ids_shape("extra_indices", extra_indices, b, s_q, "extra_topk")
    elif extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_indices")
    fit = num_parts is None and not batch_invariant
    if batch_invariant:
        num_parts = _invariant_num_parts(b, s_q, h_q, topk, extra_topk, num_parts, config)
    elif num_parts is None:
        num_parts = default_num_parts(s_q, h_q, config)
    if not isinstance(num_parts, (int, np.integer)) or not 1 <= num_parts <= MAX_NUM_PARTS:
        raise ValueError(f"num_parts: expected an int in [1, {MAX_NUM_PARTS}], got {num_parts!r}")
    divisor = s_q * math.ceil(h_q / HEADS_PER_CTA)
    unsplit = False
    if topk_length is None and extra_topk_length is None:  # the plan follows from the shapes
        if fit:  # fitted now rather than by the handler, so that the pieces are known here
            fitted = _parts_fitted_while_tracing(num_parts, divisor)
            if fitted is not None:
                num_parts, fit = fitted, False
        unsplit = not fit and not _ffi.full_lists_plan_splits(batch_invariant, b, topk, extra_topk, int(num_parts))
    lengths = lengths_or_full("topk_length", topk_length, b, topk)
    extra_lengths = lengths_or_full("extra_topk_length", extra_topk_length, b, extra_topk)
    sched, num_splits = jax.ffi.ffi_call(
        _ffi.PLAN_TARGET,
        (
            jax.ShapeDtypeStruct((int(num_parts), 8), jnp.int32),
            jax.ShapeDtypeStruct((b + 1,), jnp.int32),
        ),
        # Under vmap every mapped element gets its own plan (a loop over tiny calls);
        # sparse_mla_decode under vmap plans the folded batch itself.
        vmap_method="sequential",
    )(
        lengths,
        extra_lengths,
        topk=np.int64(topk),
        extra_topk=np.int64(extra_topk),
        num_parts=np.int64(num_parts),
        fit_to_device=bool(fit),
        parts_divisor=np.int64(divisor),
        batch_invariant=batch_invariant,
    )
    return DecodePlan(sched=sched, num_splits=num_splits, batch=b, topk=topk, extra_topk=extra_topk,
                      batch_invariant=batch_invariant, unsplit=unsplit)


def _parts_fitted_while_tracing(num_parts: int, divisor: int) -> int | None:
    """The worker count the CUDA plan handler's fit would give, asked of the handler's own code
    on this thread's current GPU (GPU 0: every GPU of a process is taken to be the same part);
    None where there is none (the handler then fits at run time). The CPU handler does not fit."""
    if jax.default_backend() == "cpu":
        return num_parts
    fitted = _ffi.cuda_fitted_parts(num_parts, divisor)
    return fitted if fitted >= 1 else None


def _invariant_num_parts(b: int, s_q: int, h_q: int, topk: int, extra_topk: int, num_parts, config) -> int:
    """The worker count of a batch-invariant plan: the caller's `num_parts`, or the larger of
    the fewest it can have and the default count."""
    need = _ffi.invariant_parts_needed(b, topk, extra_topk)
    if need > MAX_NUM_PARTS:
        raise ValueError(
            f"batch_invariant: b={b} requests of up to {_ffi.max_chunks(topk, extra_topk)} chunks need {need} "
            f"workers, more than {MAX_NUM_PARTS}; decode fewer requests per call")
    if num_parts is None:
        return max(need, default_num_parts(s_q, h_q, config))
    if isinstance(num_parts, (int, np.integer)) and num_parts < need:
        raise ValueError(
            f"num_parts: a batch-invariant plan gives each chunk of {_ffi.CHUNK_BLOCKS} blocks of a request its own "
            f"worker, so it needs 1 + b * (max_chunks - 1) = {need} workers here; expected num_parts >= {need} "
            f"(or None), got {num_parts}")
    return num_parts


def lengths_or_full(name: str, lengths, batch: int, full: int):
    if lengths is None:
        return jnp.full((batch,), full, jnp.int32)
    lengths = _ints.lengths_int32(lengths, full)
    _checks.check_lengths(name, lengths, batch)
    return lengths


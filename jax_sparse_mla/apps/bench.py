"""Timing of `sparse_mla_decode` against the pure-JAX paths and FlashMLA's published times.

    python -m jax_sparse_mla bench --shapes v32_h128_s2_b128_k2048 --iters 20
    python benchmarks/bench_decode.py --shapes all --plot bench.png
    python -m jax_sparse_mla bench --allow-cpu --shapes v32_h16_s1_b2_k64_p16_n256   # a custom shape

Inputs are built like FlashMLA's test generator: every request owns its own pages of the cache,
scattered at random; each query row picks `topk` distinct random tokens of its request; every
cache slot no valid entry points at holds NaN bytes; the sink is on. The plan is computed once.
One timing is N back-to-back calls inside one jitted function (N >= 8, each on its own set of q
and indices: XLA would merge identical calls, and small shapes must not run out of L2), divided by N.

Two figures per call, for our op and for both pure-JAX paths:
- device µs (the first column): one more repetition runs under `jax.profiler.trace` and the span of
  its device events, first kernel start to last kernel end, is divided by N (`trace_summary`). This
  is kernel time plus the gaps between kernels, without the host's cost of dispatching and awaiting
  the executable; it is the figure to compare with kernel times (ncu, FlashMLA's).
- wall µs: the median over `--iters` dispatches of the wall time of one dispatch, divided by N; it
  includes the fixed cost of dispatching and awaiting one XLA executable (~0.3 ms on a GPU), spread
  over the N calls as in a decode loop where the host runs ahead.
(The whole-cache reference, at milliseconds a call, runs once per dispatch: N = 1.) Where the
profiler fails (e.g. no CUPTI) or records no device events (the CPU backend), the device figure is
missing and that row falls back to wall time, said in a note under the table.

TFLOP/s and GB/s (docs/performance.md, Cost accounting) use `us` (device µs where measured); the
ratios "x" to the two pure-JAX paths timed in the same run,
`reference.sparse_mla_decode` (dequantizes the whole cache) and the gather-first path a JAX user
writes (gather -> dequantize -> einsum -> softmax -> einsum), divide device by device time when both
have it, else wall by wall (marked "(wall)"). FlashMLA's published time on an H200 is printed
beside, with `us` over it.

JSON rows (`--json`): `us` is the device µs per call when the profiler gave it, else the wall µs;
`timing` says which ("device" or "wall"), `device_us` (None when missing, with `device_error` saying
why) and `wall_us` hold both. The XLA paths have the same keys behind a prefix: `xla_gather_us`,
`xla_gather_timing`, `xla_gather_device_us`, `xla_gather_wall_us`, and `xla_ref_...`. `trace` holds
our op's profiled repetition (per-call span, busy and idle µs, per-kernel µs; printed with --trace).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm
from jax_sparse_mla import formats, reference
from jax_sparse_mla.apps import trace_summary
from jax_sparse_mla.formats import KVFormat

__all__ = ["Shape", "PRESETS", "main", "run_shape", "shape_from_name", "table"]


@dataclasses.dataclass(frozen=True)
class Shape:
    fmt: str  # "V32" or "MODEL1"
    h_q: int
    s_q: int
    b: int
    topk: int
    page: int = 64
    s_k: int = 32768  # tokens of each request in the main cache
    extra_topk: int = 0
    extra_page: int = 64
    extra_s_k: int = 0
    invalid_tail: int = 0  # the last entries of every list are -1, as an indexer pads a short context's
    flashmla_us: float | None = None  # FlashMLA's published time, H200 (docs/performance.md)
    perf_xla_us: float | None = None  # the pure-JAX path's published time (docs/performance.md)
    label: str = ""  # the name a custom shape was asked for by (it names its page and token counts)

    @property
    def valid_entries(self) -> int:
        """Valid (not -1) list entries of one query row, main and extra lists together."""
        lists = 2 if self.extra_topk else 1
        return self.topk + self.extra_topk - lists * self.invalid_tail

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        n = f"{self.fmt.lower()}_h{self.h_q}_s{self.s_q}_b{self.b}_k{self.topk}"
        return n + (f"_x{self.extra_topk}" if self.extra_topk else "")


def _v32(h_q, s_q, b, topk=2048, fm=None, xla=None, s_k=None):
    return Shape("V32", h_q, s_q, b, topk, s_k=s_k or max(32768, 4 * topk), flashmla_us=fm, perf_xla_us=xla)


def _m1(h_q, s_q, b, extra_topk, fm=None, xla=None):
    return Shape("MODEL1", h_q, s_q, b, 128, page=256, s_k=8192, extra_topk=extra_topk, extra_page=64,
                 extra_s_k=4 * extra_topk, flashmla_us=fm, perf_xla_us=xla)


_ALL = [
    _v32(128, 2, 2, fm=23.5),
    _v32(128, 2, 64, fm=188.3, xla=831),
    _v32(128, 2, 74, fm=227.6),
    _v32(128, 2, 128, fm=366.0, xla=1551),
    _v32(128, 2, 1, fm=21.7),
    _v32(128, 4, 128, fm=723.4, xla=3025),
    _v32(128, 1, 1, fm=22.4, xla=168),
    _v32(128, 1, 32, fm=67.9),
    _v32(128, 1, 64, fm=100.4),
    _v32(128, 1, 128, fm=189.5, xla=818),
    _v32(64, 1, 64, fm=80.3, xla=387),
    _v32(64, 1, 128, fm=120.8),
    _v32(64, 2, 1, fm=23.0),
    _v32(64, 2, 64, fm=121.0),
    _v32(64, 2, 128, fm=230.9, xla=1374),
    # tensor-parallel shards of V3.2 (FlashMLA pads these to 64 heads)
    _v32(32, 2, 128, fm=230.9),
    _v32(16, 2, 128, fm=230.9),
    _v32(32, 2, 1),
    _v32(16, 2, 1),
    # tensor-parallel shards of a MODEL1 model (FlashMLA pads these to 64 heads)
    _m1(16, 2, 128, 512, fm=95.0),
    _m1(32, 2, 128, 512, fm=95.0),
    _m1(64, 2, 64, 512, fm=52.9),
    _m1(64, 2, 128, 512, fm=95.0),
    _m1(64, 2, 256, 512, fm=177.2),
    _m1(128, 2, 64, 1024, fm=109.2),
    _m1(128, 2, 128, 1024, fm=208.0),
    _m1(128, 2, 256, 1024, fm=404.9),
    _v32(128, 2, 148, topk=16384, fm=3111.8),
    Shape("MODEL1", 128, 2, 148, 16384, page=64, s_k=65536, flashmla_us=2835.8),
]
PRESETS = {s.name: s for s in _ALL}
CUSTOM_FORMAT = "{v32|model1}_hH_sS_bB_kTOPK[_xEXTRA][_pPAGE][_nTOKENS][_iINVALID]"
_CUSTOM = re.compile(r"(?P<fmt>v32|model1)_h(?P<h>\d+)_s(?P<s>\d+)_b(?P<b>\d+)_k(?P<k>\d+)"
                     r"(?:_x(?P<x>\d+))?(?:_p(?P<p>\d+))?(?:_n(?P<n>\d+))?(?:_i(?P<i>\d+))?")


def shape_from_name(name: str) -> Shape:
    """A preset by name, or a custom shape (CUSTOM_FORMAT): page 64, TOKENS per request
    max(32768, 4 TOPK) unless given; the extra cache of MODEL1 has pages of 64 and 4 EXTRA tokens
    per request; with _iINVALID the last INVALID entries of every list (main and extra) are -1, as
    an indexer pads the list of a context shorter than top-k. E.g. v32_h16_s1_b2_k64_p16_n256 runs
    in seconds on a CPU."""
    if name in PRESETS:
        return PRESETS[name]
    m = _CUSTOM.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown shape {name!r}: a preset (see --list) or {CUSTOM_FORMAT}")
    topk, extra = int(m["k"]), int(m["x"] or 0)
    if extra and m["fmt"] == "v32":
        raise ValueError(f"{name!r}: only MODEL1 has an extra cache (_x)")
    s_k = int(m["n"] or max(32768, 4 * topk))
    if s_k < topk:
        raise ValueError(f"{name!r}: {s_k} tokens per request is fewer than topk {topk}")
    invalid = int(m["i"] or 0)
    if invalid >= min(topk, extra or topk):
        raise ValueError(f"{name!r}: {invalid} invalid entries leave a list empty (topk {topk}, extra {extra})")
    return Shape(m["fmt"].upper(), int(m["h"]), int(m["s"]), int(m["b"]), topk, page=int(m["p"] or 64), s_k=s_k,
                 extra_topk=extra, extra_s_k=4 * extra, invalid_tail=invalid, label=name)


# A quick default: the shape of the 3x bar, plus one small and one MODEL1 shape.
DEFAULT_SHAPES = ["v32_h128_s2_b128_k2048", "v32_h128_s2_b1_k2048", "model1_h128_s2_b128_k128_x1024"]


# ---- inputs -----------------------------------------------------------------------------------

def _paged_list(rng, b, s_q, topk, s_k, page, invalid=0):
    """Page tables and per-row distinct token picks, the last `invalid` of each row -1; returns
    global indices and the page count."""
    pages_per_req = -(-s_k // page)
    num_blocks = b * pages_per_req
    table = rng.permutation(num_blocks).reshape(b, pages_per_req)
    lens = np.clip(rng.integers(s_k - s_k // 8, s_k + 1, size=b), topk, pages_per_req * page)
    idx = np.empty((b, s_q, topk), np.int64)
    for i in range(b):
        for s in range(s_q):
            tok = rng.choice(lens[i], size=topk, replace=False)
            idx[i, s] = table[i, tok // page] * page + tok % page
    idx[..., topk - invalid:] = -1
    return idx.astype(np.int32), num_blocks


def _cache(key, fmt: KVFormat, num_blocks, page, used_slots):
    """Random keys quantized on the device; every slot not in `used_slots` is NaN bytes."""
    @jax.jit
    def build(key, used):
        keys = jax.random.normal(key, (num_blocks, page, fmt.d_qk), jnp.float32)
        keys = (keys * jnp.exp(jax.random.uniform(key, (num_blocks, page, 1), minval=-1.0, maxval=1.0)))
        rows = formats.quantize_tokens(keys.astype(jnp.bfloat16), fmt)
        rows = jnp.where(used.reshape(num_blocks, page, 1), rows, jnp.uint8(0xFF))
        return formats.rows_to_cache(rows, fmt)

    used = np.zeros(num_blocks * page, bool)
    used[used_slots] = True
    return build(key, jnp.asarray(used))


@dataclasses.dataclass
class Inputs:
    qs: list
    idxs: list
    kv: jax.Array
    extra_idxs: list | None
    extra_kv: jax.Array | None
    sink: jax.Array
    distinct_tokens: float  # per call, averaged over the sets


def make_inputs(shape: Shape, sets: int, seed: int = 0) -> Inputs:
    fmt = KVFormat.coerce(shape.fmt)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    lists, extra_lists = [], []
    for _ in range(sets):
        idx, nb = _paged_list(rng, shape.b, shape.s_q, shape.topk, shape.s_k, shape.page, shape.invalid_tail)
        lists.append(idx)
        if shape.extra_topk:
            eidx, enb = _paged_list(rng, shape.b, shape.s_q, shape.extra_topk, shape.extra_s_k, shape.extra_page,
                                    shape.invalid_tail)
            extra_lists.append(eidx)
    # One cache (the tables above all have the same block count); pages differ per set.
    kv = _cache(key, fmt, nb, shape.page, np.concatenate([x.reshape(-1) for x in lists]))
    extra_kv = None
    if shape.extra_topk:
        extra_kv = _cache(jax.random.fold_in(key, 1), fmt, enb, shape.extra_page,
                          np.concatenate([x.reshape(-1) for x in extra_lists]))
    qs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (shape.b, shape.s_q, shape.h_q, fmt.d_qk),
                            jnp.float32).astype(jnp.bfloat16) for i in range(sets)]
    sink = jnp.asarray(rng.normal(1.0, 1.0, size=shape.h_q).astype(np.float32))
    distinct = np.mean([np.unique(x[x >= 0]).size for x in lists])
    if shape.extra_topk:
        distinct += np.mean([np.unique(x[x >= 0]).size for x in extra_lists])
    return Inputs(qs=[jnp.asarray(q) for q in qs], idxs=[jnp.asarray(x) for x in lists], kv=kv,
                  extra_idxs=[jnp.asarray(x) for x in extra_lists] if shape.extra_topk else None,
                  extra_kv=extra_kv, sink=sink, distinct_tokens=float(distinct))


# ---- the pure-JAX gather-first path -------------------------------------------------------------

def _gather_rows(kv, idx, fmt: KVFormat):
    nb, ps = kv.shape[0], kv.shape[1]
    n = nb * ps
    safe = jnp.clip(idx, 0, n - 1)
    if fmt is KVFormat.V32:
        return kv.reshape(n, fmt.bytes_per_token)[safe]
    flat = kv.reshape(nb, ps * fmt.bytes_per_token)
    region_a = flat[:, : ps * 576].reshape(n, 576)
    region_b = flat[:, ps * 576 :].reshape(n, 8)
    return jnp.concatenate([region_a[safe], region_b[safe]], axis=-1)


def xla_gather_decode(q, kv, idx, sink, extra_kv=None, extra_idx=None, *, sm_scale):
    """gather -> dequantize -> einsum -> softmax -> einsum, bf16 operands, fp32 accumulation, the
    probabilities rounded the kernels' way (docs/numerics.md)."""
    fmt = KVFormat.from_d_qk(q.shape[-1])
    keys, valid = [], []
    for cache, ix in ((kv, idx), (extra_kv, extra_idx)):
        if cache is None:
            continue
        keys.append(formats.dequantize_tokens(_gather_rows(cache, ix, fmt), fmt))
        valid.append((ix >= 0) & (ix < cache.shape[0] * cache.shape[1]))
    k = jnp.concatenate(keys, axis=2)
    ok = jnp.concatenate(valid, axis=2)
    k = jnp.where(ok[..., None], k, 0)
    z = jnp.einsum("bshd,bsnd->bshn", q, k, preferred_element_type=jnp.float32) * sm_scale
    z = jnp.where(ok[:, :, None, :], z, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    p = jnp.exp(z - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    lse = (m + jnp.log(denom))[..., 0]
    # Unnormalized probabilities into P·V, as the kernels round them: the largest is exactly 1 in
    # bf16, and the float32 sum divides afterwards (normalizing first rounds every term).
    out = jnp.einsum("bshn,bsnd->bshd", p.astype(jnp.bfloat16), k[..., :512],
                     preferred_element_type=jnp.float32) / denom
    out = out / (1.0 + jnp.exp(sink[None, None, :] - lse))[..., None]
    return out.astype(jnp.bfloat16), jnp.transpose(lse, (0, 2, 1))


# ---- timing -----------------------------------------------------------------------------------

def _time(fn, args, iters: int, calls: int) -> float:
    """Median µs per call of `fn(*args)` that makes `calls` calls."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(samples)


def cost(shape: Shape, distinct_tokens: float):
    fmt = KVFormat.coerce(shape.fmt)
    n = shape.b * shape.s_q * shape.valid_entries
    flop = 2.0 * shape.h_q * n * (fmt.d_qk + 512)
    token_bytes = 656 if fmt is KVFormat.V32 else 576
    nbytes = (shape.b * shape.s_q * shape.h_q * (fmt.d_qk + 512) * 2) + distinct_tokens * token_bytes
    return flop, nbytes


CALLS_PER_TIMING = 8


# Under ncu, CUPTI refuses a second subscriber: jax logs the error and records host events only.
NO_DEVICE_EVENTS = "the profiler recorded no device events (CPU backend, or CUPTI unavailable or held by ncu)"


def _device_time(fn, args, calls: int, trace_dir: str) -> dict:
    """One more repetition of `fn(*args)` under the profiler, its trace written under `trace_dir`.

    Returns the per-call device span, busy and idle µs and per-kernel µs, or {"error": why} when
    the profiler fails (e.g. no CUPTI) or records no device events (the CPU backend)."""
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
    except Exception as e:  # the wall time still stands; the caller falls back to it
        return {"error": f"profiler failed: {type(e).__name__}: {str(e)[:200]}"}
    path = trace_summary.latest_trace_file(trace_dir)
    if path is None:
        return {"error": "the profiler wrote no perfetto trace"}
    try:
        s = trace_summary.summarize_file(path)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a trace format this reader does not know
        return {"error": f"could not read the profiler's trace: {type(e).__name__}: {str(e)[:200]}"}
    if not s["kernels"] or s["span_us"] <= 0:
        return {"error": NO_DEVICE_EVENTS}
    return dict(file=path, calls=calls, span_us=s["span_us"] / calls, busy_us=s["busy_us"] / calls,
                idle_us=s["idle_us"] / calls,
                kernels={name: k["total_us"] / calls for name, k in s["kernels"].items()},
                text=trace_summary.format_summary(s, calls))


def _measure(prefix: str, fn, args, iters: int, calls: int, trace_dir: str) -> tuple[dict, dict]:
    """Wall and device µs per call of `fn(*args)` (which makes `calls` calls), as row keys behind
    `prefix` (see the module docstring), and the profiled repetition's details."""
    wall = _time(fn, args, iters, calls)
    trace = _device_time(fn, args, calls, trace_dir)
    device = trace.get("span_us")
    keys = {f"{prefix}us": wall if device is None else device,
            f"{prefix}timing": "wall" if device is None else "device",
            f"{prefix}device_us": device, f"{prefix}wall_us": wall}
    if device is None:
        keys[f"{prefix}device_error"] = trace["error"]
    return keys, trace


def _sets_for(shape: Shape) -> int:
    """Enough q/index sets that consecutive calls touch more than twice the 60 MB L2."""
    per_call = shape.b * shape.s_q * (shape.topk + shape.extra_topk) * 656
    return int(min(32, max(2, math.ceil(120e6 / per_call))))


def run_shape(shape: Shape, iters: int = 20, xla: bool = True, reference_path: bool = True,
              trace_dir: str | None = None, batch_invariant: bool = False) -> dict:
    """Times one shape (wall and device time, see the module docstring). The profiler's traces go
    under `trace_dir`/<shape>/ when given (kept), else into a temporary directory (removed).
    `batch_invariant`: our op with the batch-invariant plan (README "Reproducibility")."""
    if trace_dir is not None:
        return _run_shape(shape, iters, xla, reference_path, os.path.join(trace_dir, shape.name), keep=True,
                          batch_invariant=batch_invariant)
    with tempfile.TemporaryDirectory(prefix="jsm_bench_trace_") as tmp:
        return _run_shape(shape, iters, xla, reference_path, tmp, keep=False, batch_invariant=batch_invariant)


def _run_shape(shape: Shape, iters: int, xla: bool, reference_path: bool, trace_dir: str, keep: bool,
               batch_invariant: bool) -> dict:
    # One input set per call: XLA merges calls with identical operands (they are pure).
    sets = max(_sets_for(shape), CALLS_PER_TIMING)
    inp = make_inputs(shape, sets)
    fmt = KVFormat.coerce(shape.fmt)
    sm_scale = fmt.d_qk ** -0.5
    extra = shape.extra_topk > 0
    plan = jax.jit(lambda q, i, e: jsm.plan_decode(q, i, extra_indices=e, batch_invariant=batch_invariant))(
        inp.qs[0], inp.idxs[0], inp.extra_idxs[0] if extra else None)
    jax.block_until_ready(plan)

    def one(q, idx, eidx, kv, ekv, sink, plan):
        kw = dict(extra_kv_cache=ekv, extra_indices=eidx) if extra else {}
        return jsm.sparse_mla_decode(q, kv, idx, sm_scale=sm_scale, attn_sink=sink, plan=plan,
                                     batch_invariant=batch_invariant, **kw)

    calls = sets

    @jax.jit
    def ours(qs, idxs, eidxs, kv, ekv, sink, plan):
        return [one(qs[i], idxs[i], eidxs[i] if extra else None, kv, ekv, sink, plan)
                for i in range(calls)]

    eidxs = inp.extra_idxs if extra else [None] * sets
    args = (inp.qs, inp.idxs, eidxs, inp.kv, inp.extra_kv, inp.sink, plan)
    timing, trace = _measure("", ours, args, iters, calls, os.path.join(trace_dir, "ours"))
    if not keep:
        trace.pop("file", None)  # it is about to be removed
    us = timing["us"]
    flop, nbytes = cost(shape, inp.distinct_tokens)
    row = dict(shape=shape.name, fmt=shape.fmt, h_q=shape.h_q, s_q=shape.s_q, b=shape.b, topk=shape.topk,
               extra_topk=shape.extra_topk, **timing, tflops=flop / us * 1e-6, gbs=nbytes / us * 1e-3,
               flashmla_us=shape.flashmla_us, perf_xla_us=shape.perf_xla_us, sets=sets, trace=trace,
               batch_invariant=batch_invariant)

    def measure_xla(prefix, fn, args, calls):
        try:
            row.update(_measure(prefix, fn, args, max(3, iters // 4), calls, os.path.join(trace_dir, prefix[:-1]))[0])
        except Exception as e:  # e.g. out of memory on the largest shapes
            row.update({f"{prefix}us": None, f"{prefix}error": f"{type(e).__name__}: {str(e)[:200]}"})

    if xla:
        @jax.jit
        def gather_path(qs, idxs, eidxs, kv, ekv, sink):
            return [xla_gather_decode(qs[i], kv, idxs[i], sink, ekv if extra else None,
                                      eidxs[i] if extra else None, sm_scale=sm_scale)
                    for i in range(calls)]

        measure_xla("xla_gather_", gather_path, (inp.qs, inp.idxs, eidxs, inp.kv, inp.extra_kv, inp.sink), calls)
    if reference_path:
        @jax.jit
        def ref_path(q, idx, eidx, kv, ekv, sink):
            kw = dict(extra_kv_cache=ekv, extra_indices=eidx) if extra else {}
            return reference.sparse_mla_decode(q, kv, idx, sm_scale=sm_scale, attn_sink=sink, **kw)

        # At milliseconds a call, one call per dispatch.
        measure_xla("xla_ref_", ref_path, (inp.qs[0], inp.idxs[0], eidxs[0], inp.kv, inp.extra_kv, inp.sink), 1)
    del inp, args, plan
    gc.collect()
    return row


def _compare(row: dict, prefix: str):
    """(ours µs, theirs µs, measure) for the ratio to the XLA path `prefix`, both in one measure:
    device time when both have it, else wall time; theirs is None when that path did not run."""
    if row.get(f"{prefix}us") is None:
        return row["us"], None, row["timing"]
    if row["device_us"] is not None and row.get(f"{prefix}device_us") is not None:
        return row["device_us"], row[f"{prefix}device_us"], "device"
    return row["wall_us"], row[f"{prefix}wall_us"], "wall"


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


TABLE_LEGEND = ("device µs/call = profiler span of N back-to-back calls / N; wall µs/call = median wall time "
                "of one dispatch of them / N. TFLOP/s, GB/s and ours/FlashMLA use device µs; x = XLA path's "
                "time over ours, device over device (wall over wall where marked).")


def table(rows) -> str:
    """A markdown table, the legend, and a note for every row whose device time is missing."""
    lines = ["| shape | device µs/call | wall µs/call | TFLOP/s | GB/s | XLA gather µs | x | XLA ref µs | x "
             "| FlashMLA µs | ours/FlashMLA |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        cells = [r["shape"], _fmt(r["device_us"], ".1f"), _fmt(r["wall_us"], ".1f"), f"{r['tflops']:.0f}",
                 f"{r['gbs']:.0f}"]
        for prefix in ("xla_gather_", "xla_ref_"):
            ours, theirs, measure = _compare(r, prefix)
            mark = " (wall)" if measure != r["timing"] else ""
            cells += [_fmt(theirs, ".1f") + (mark if theirs else ""),
                      _fmt(theirs / ours if theirs else None, ".2f") + (mark if theirs else "")]
        fm = r.get("flashmla_us")
        cells += [_fmt(fm, ".1f"), _fmt(r["us"] / fm if fm else None, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
        if r["timing"] != "device":
            notes.append(f"note: {r['shape']}: no device time: {r.get('device_error', 'not measured')}; "
                         "its TFLOP/s, GB/s and ratios use wall µs")
    return "\n".join(lines + [TABLE_LEGEND] + notes)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["shape"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 5))
    pairs = [_compare(r, "xla_gather_") for r in rows]  # ours and gather-first in one measure per shape
    series = [("jax_sparse_mla", [ours for ours, _, _ in pairs]),
              ("XLA gather-first", [theirs or np.nan for _, theirs, _ in pairs]),
              ("FlashMLA (published)", [r.get("flashmla_us") or np.nan for r in rows])]
    for k, (label, vals) in enumerate(series):
        ax.bar(x + (k - 1) * 0.27, vals, 0.27, label=label)
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("µs per call (device time; wall where the profiler gave none)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@contextlib.contextmanager
def _progress(total: int):
    """A progress bar over the shapes on stderr (rich), or nothing when rich is missing."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        yield lambda name: None
        return
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("shapes", total=total)
        yield lambda name: bar.update(task, advance=1, description=name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                    help=f"preset names (see --list), 'all', or custom shapes {CUSTOM_FORMAT}")
    ap.add_argument("--iters", type=int, default=20, help="timed repetitions per shape (median reported)")
    ap.add_argument("--no-xla", action="store_true", help="skip the gather-first pure-JAX path")
    ap.add_argument("--no-reference", action="store_true", help="skip reference.sparse_mla_decode")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG bar chart")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--trace", metavar="DIR",
                    help="keep the profiler's Perfetto traces under DIR/<shape>/ (by default they go to a "
                         "temporary directory, removed) and print our op's device span, busy, idle and "
                         "per-kernel µs per call")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="time our op with the batch-invariant plan (README 'Reproducibility')")
    ap.add_argument("--list", action="store_true", help="list the presets and exit")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run even without a GPU (the presets then take minutes and time the C++ CPU path)")
    args = ap.parse_args(argv)
    if args.list:
        for name, s in PRESETS.items():
            print(name, f"FlashMLA {s.flashmla_us} µs" if s.flashmla_us else "")
        return 0
    names = list(PRESETS) if args.shapes == ["all"] else args.shapes
    try:
        shapes = [shape_from_name(n) for n in names]
    except ValueError as e:
        ap.error(str(e))
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        print("bench: no GPU visible to JAX. The presets are GPU-sized and would time the C++ CPU path "
              "for minutes; pass --allow-cpu to run anyway.", file=sys.stderr)
        return 2
    print(f"devices: {jax.devices()}  jax {jax.__version__}")
    rows = []
    with _progress(len(shapes)) as advance:
        for shape in shapes:
            row = run_shape(shape, iters=args.iters, xla=not args.no_xla, reference_path=not args.no_reference,
                            trace_dir=args.trace, batch_invariant=args.batch_invariant)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            if args.trace:
                print(f"{shape.name}: " + row["trace"].get("text", row["trace"].get("error", "")), flush=True)
            advance(shape.name)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

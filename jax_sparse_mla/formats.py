"""The FP8 paged latent-cache formats (docs/formats.md), in pure (jit-able) JAX.

Two formats exist, told apart by the key width ``d_qk``:

* ``V32`` (DeepSeek V3.2), ``d_qk = 576``, 656 bytes per token, token after token::

      [0, 512)    512 float8_e4m3fn NoPE codes
      [512, 528)  4 little-endian float32 scales, one per 128 NoPE dims
      [528, 656)  64 bf16 RoPE dims

* ``MODEL1``, ``d_qk = 512``, 584 bytes per token, *page-planar*: a page of ``P`` tokens is
  region A (``P * 576`` bytes, token ``t`` at ``t * 576``: 448 fp8 codes then 64 bf16 RoPE dims)
  followed by region B (``P * 8`` bytes, token ``t`` at ``P*576 + t*8``: 7 UE8M0 scale bytes, one
  per 64 NoPE dims, then one zero padding byte).

Besides the cache-level functions (:func:`quantize_kv`, :func:`dequantize_kv`, :func:`write_kv`)
this module works with *token rows*: the ``bytes_per_token`` bytes of one token in logical order.
For V32 a token row is exactly the cache layout; for MODEL1 it is
``[576 region-A bytes | 8 region-B bytes]`` of the token, which the page-planar cache splits
into its two regions (:func:`rows_to_cache`, :func:`cache_to_rows`).

Every function here takes the format as a :class:`KVFormat` or as its name (``"V32"`` /
``"MODEL1"``); it must be static under ``jax.jit``.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from jax_sparse_mla import _ints

__all__ = [
    "D_V",
    "KVFormat",
    "cache_to_rows",
    "dequantize_kv",
    "dequantize_tokens",
    "quantize_kv",
    "quantize_tokens",
    "rows_to_cache",
    "write_kv",
]

#: Width of the value vector (the first ``D_V`` dims of the key), the same for both formats.
D_V = 512
#: Largest finite float8_e4m3fn magnitude.
FP8_MAX = 448.0
#: Width of one MODEL1 region-A token record (fp8 NoPE codes + bf16 RoPE).
_MODEL1_DATA_BYTES = 576
#: Width of one MODEL1 region-B token record (7 scale bytes + 1 padding byte).
_MODEL1_SCALE_BYTES = 8

#: Dtypes a cache's raw bytes may have (the same bytes read as uint8).
CACHE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


class _Params(NamedTuple):
    d_qk: int
    d_nope: int
    d_rope: int
    bytes_per_token: int
    tile_dims: int
    num_tiles: int
    code: int


class KVFormat(enum.Enum):
    """A cache byte format (docs/formats.md)."""

    V32 = "V32"
    MODEL1 = "MODEL1"

    @property
    def _p(self) -> _Params:
        return _PARAMS[self]

    @property
    def d_qk(self) -> int:
        """Key (and query) width: 576 (V32) or 512 (MODEL1)."""
        return self._p.d_qk

    @property
    def d_nope(self) -> int:
        """Number of fp8-quantized NoPE dims: 512 (V32) or 448 (MODEL1)."""
        return self._p.d_nope

    @property
    def d_rope(self) -> int:
        """Number of bf16 RoPE dims (64), stored after the NoPE dims."""
        return self._p.d_rope

    @property
    def d_v(self) -> int:
        """Value width (512 for both formats)."""
        return D_V

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token: 656 (V32) or 584 (MODEL1)."""
        return self._p.bytes_per_token

    @property
    def tile_dims(self) -> int:
        """NoPE dims sharing one scale: 128 (V32) or 64 (MODEL1)."""
        return self._p.tile_dims

    @property
    def num_tiles(self) -> int:
        """Scales per token: 4 (V32) or 7 (MODEL1)."""
        return self._p.num_tiles

    @property
    def code(self) -> int:
        """Integer id used by the C++ side: 0 for V32, 1 for MODEL1."""
        return self._p.code

    @classmethod
    def from_d_qk(cls, d_qk: int) -> "KVFormat":
        """The format whose key width is ``d_qk`` (576 -> V32, 512 -> MODEL1)."""
        for fmt in cls:
            if fmt.d_qk == d_qk:
                return fmt
        raise ValueError(
            f"d_qk must be one of {{576, 512}} (576 -> V32, 512 -> MODEL1), got d_qk={d_qk!r}"
        )

    @classmethod
    def from_bytes_per_token(cls, nbytes: int) -> "KVFormat":
        """The format whose token takes ``nbytes`` cache bytes (656 -> V32, 584 -> MODEL1)."""
        for fmt in cls:
            if fmt.bytes_per_token == nbytes:
                return fmt
        raise ValueError(
            "bytes_per_token (the cache's last dim) must be one of {656, 584} "
            f"(656 -> V32, 584 -> MODEL1), got {nbytes!r}"
        )

    @classmethod
    def coerce(cls, fmt: "KVFormat | str") -> "KVFormat":
        """Accept a :class:`KVFormat` or its name (case-insensitive)."""
        if isinstance(fmt, cls):
            return fmt
        if isinstance(fmt, str):
            try:
                return cls[fmt.upper()]
            except KeyError:
                pass
            raise ValueError(f"fmt must be 'V32' or 'MODEL1', got {fmt!r}")
        raise TypeError(f"fmt must be a KVFormat or one of 'V32'/'MODEL1', got {type(fmt).__name__}")


_PARAMS = {
    KVFormat.V32: _Params(
        d_qk=576, d_nope=512, d_rope=64, bytes_per_token=656, tile_dims=128, num_tiles=4, code=0
    ),
    KVFormat.MODEL1: _Params(
        d_qk=512, d_nope=448, d_rope=64, bytes_per_token=584, tile_dims=64, num_tiles=7, code=1
    ),
}


# --------------------------------------------------------------------------------------------
# validation helpers


def _resolve_format(fmt, *, d_qk=None, nbytes=None, who="") -> KVFormat:
    """``fmt`` coerced, or inferred from ``d_qk`` / ``nbytes`` when None."""
    if fmt is not None:
        return KVFormat.coerce(fmt)
    if d_qk is not None:
        return KVFormat.from_d_qk(d_qk)
    if nbytes is not None:
        return KVFormat.from_bytes_per_token(nbytes)
    raise ValueError(f"{who}: cannot infer the cache format, pass fmt")  # pragma: no cover


def _check_bf16(x, name: str, fn: str) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(f"{fn}: {name} must have dtype bfloat16, got {jnp.dtype(x.dtype).name}")


def _check_last_dim(x, expected: int, name: str, fn: str, fmt: KVFormat) -> None:
    if x.ndim < 1 or x.shape[-1] != expected:
        got = x.shape[-1] if x.ndim else "a scalar"
        raise ValueError(
            f"{fn}: {name} last dim must be {expected} for format {fmt.name}, got {got} "
            f"(shape {tuple(x.shape)})"
        )


def cache_layout_problem(shape, fmt: "KVFormat | None") -> str | None:
    """What is wrong with a cache array's shape, if anything: ``"rank4"`` (a rank-4 cache whose
    dim 2 is not 1), ``"rank"`` (neither rank 3 nor 4) or ``"bytes"`` (last dim is not ``fmt``'s
    bytes per token; not checked when ``fmt`` is None). The one statement of the layout rule;
    each API words its own error."""
    shape = tuple(shape)
    if len(shape) == 4 and shape[2] != 1:
        return "rank4"
    if len(shape) not in (3, 4):
        return "rank"
    if fmt is not None and shape[-1] != fmt.bytes_per_token:
        return "bytes"
    return None


def _check_cache(shape, dtype, fmt, fn: str, name: str = "cache") -> KVFormat:
    """Validate a cache's shape and dtype; return its format (``fmt`` or inferred)."""
    dt = jnp.dtype(dtype)
    shape = tuple(shape)
    if dt not in CACHE_DTYPES:
        raise TypeError(
            f"{fn}: {name} must have dtype uint8, int8 or float8_e4m3fn (raw cache bytes), "
            f"got {dt.name}"
        )
    problem = cache_layout_problem(shape, None)
    if problem == "rank4":
        raise ValueError(
            f"{fn}: a rank-4 {name} must be [num_blocks, page_size, 1, bytes_per_token], "
            f"got shape {shape} (dim 2 must be 1)"
        )
    if problem == "rank":
        raise ValueError(
            f"{fn}: {name} must have rank 3 [num_blocks, page_size, bytes_per_token] or rank 4 "
            f"[num_blocks, page_size, 1, bytes_per_token], got rank {len(shape)} (shape {shape})"
        )
    fmt = _resolve_format(fmt, nbytes=shape[-1], who=fn)
    if cache_layout_problem(shape, fmt) == "bytes":
        raise ValueError(
            f"{fn}: {name} last dim (bytes per token) must be {fmt.bytes_per_token} for format "
            f"{fmt.name}, got {shape[-1]} (shape {shape})"
        )
    return fmt


def as_rank3(cache):
    """A FlashMLA-shaped ``[num_blocks, page_size, 1, bytes]`` cache as
    ``[num_blocks, page_size, bytes]`` (same bytes; a bitcast in XLA); a rank-3 cache as is."""
    shape = cache.shape
    return cache.reshape(shape[0], shape[1], shape[3]) if len(shape) == 4 else cache


def _as_byte_cache(cache, fmt, fn: str, name: str = "cache"):
    """Validate and normalise a cache to uint8 ``[num_blocks, page_size, bytes_per_token]``.

    Accepts uint8 / int8 / float8_e4m3fn (same bytes) and the FlashMLA shape
    ``[num_blocks, page_size, 1, bytes_per_token]``. Returns ``(cache_u8, fmt)``.
    """
    cache = jnp.asarray(cache)
    fmt = _check_cache(cache.shape, cache.dtype, fmt, fn, name)
    cache = as_rank3(cache)
    if jnp.dtype(cache.dtype) != jnp.dtype(jnp.uint8):
        cache = lax.bitcast_convert_type(cache, jnp.uint8)
    return cache, fmt


def _in_range(idx, n: int):
    """``0 <= idx < n`` without overflowing ``idx``'s integer type when ``n`` is large."""
    ok = idx >= 0
    if n <= jnp.iinfo(idx.dtype).max:
        ok = ok & (idx < n)
    return ok


# --------------------------------------------------------------------------------------------
# bytes <-> numbers


def _le_bytes(bits, nbytes: int):
    """Unsigned integers ``[...]`` -> their ``nbytes`` little-endian bytes ``[..., nbytes]``."""
    shifts = jnp.arange(nbytes, dtype=bits.dtype) * 8
    return ((bits[..., None] >> shifts) & 0xFF).astype(jnp.uint8)


def _from_le_bytes(b, dtype):
    """Little-endian bytes ``[..., n]`` (uint8) -> unsigned integers ``[...]`` of ``dtype``."""
    shifts = jnp.arange(b.shape[-1], dtype=dtype) * 8
    # The shifted bytes do not overlap, so their sum is their bitwise or.
    return jnp.sum(b.astype(dtype) << shifts, axis=-1, dtype=dtype)


def _bf16_to_bytes(x):
    """bf16 ``[..., n]`` -> ``[..., 2n]`` little-endian bytes."""
    bits = lax.bitcast_convert_type(x, jnp.uint16)
    return _le_bytes(bits, 2).reshape(*x.shape[:-1], 2 * x.shape[-1])


def _bytes_to_bf16(b):
    """``[..., 2n]`` little-endian bytes -> bf16 ``[..., n]``."""
    pairs = b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2)
    return lax.bitcast_convert_type(_from_le_bytes(pairs, jnp.uint16), jnp.bfloat16)


def _scale_exponent(amax):
    """Biased float32 exponent of ``s = 2 ** ceil(log2(max(amax / 448, 1e-4)))``.

    Computed from the exponent and mantissa bits of ``amax`` alone (no division, no log2/exp2,
    which XLA's CPU backend does not evaluate exactly; it even turns ``x / 448`` into
    ``x * fl(1/448)``). With ``p = 2**k`` a power of two, ``fl(amax / 448) <= p`` holds exactly
    when ``amax <= 448 * p`` (no float32 lies in ``(448p, 448p * (1 + 2**-24)]``, the values
    that would round down onto ``p``), and ``448 * p = 1.75 * 2**(k + 8)``. Writing
    ``amax = m * 2**E`` with ``m`` in ``[1, 2)``, the smallest such ``k`` is ``E - 8`` when
    ``m <= 1.75`` and ``E - 7`` otherwise. The ``1e-4`` clamp becomes ``k >= -13``
    (``2**-14 < 1e-4 < 2**-13``). Zero and subnormal ``amax`` land on the clamp.
    A non-finite ``amax`` gives exponent 255 (a NaN scale).
    """
    bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
    mant = (bits & 0x7FFFFF).astype(jnp.int32)
    k_biased = exp - 8 + (mant > 0x600000).astype(jnp.int32)  # 1.75 = 1 + 0x600000 / 2**23
    k_biased = jnp.maximum(k_biased, 127 - 13)
    return jnp.where(exp == 0xFF, 0xFF, k_biased)


def _pow2_from_exponent(e):
    """Biased exponent (int) -> float32 ``2 ** (e - 127)`` built from bits; 255 -> NaN, 0 -> 2**-127."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(
        e == 0xFF,
        jnp.uint32(0x7FC00000),
        jnp.where(e == 0, jnp.uint32(0x00400000), e << 23),
    )
    return lax.bitcast_convert_type(bits, jnp.float32)


# --------------------------------------------------------------------------------------------
# token rows


def quantize_tokens(k, fmt=None):
    """Quantize bf16 key vectors ``[..., d_qk]`` into token rows ``[..., bytes_per_token]`` uint8.

    The row is the token's bytes in logical order (docs/formats.md, "Quantizing"): for V32 exactly
    the cache layout; for MODEL1 the 576 region-A bytes followed by the 8 region-B bytes (7 scale
    exponents and a zero padding byte). ``fmt`` defaults to the format of ``k.shape[-1]``.
    """
    fn = "quantize_tokens"
    k = jnp.asarray(k)
    if k.ndim < 1:
        raise ValueError(f"{fn}: k must have rank >= 1 [..., d_qk], got a scalar")
    fmt = _resolve_format(fmt, d_qk=k.shape[-1], who=fn)
    _check_bf16(k, "k", fn)
    _check_last_dim(k, fmt.d_qk, "k", fn, fmt)
    lead = k.shape[:-1]

    nope = k[..., : fmt.d_nope].astype(jnp.float32)
    nope = nope.reshape(*lead, fmt.num_tiles, fmt.tile_dims)
    amax = jnp.max(jnp.abs(nope), axis=-1)  # [..., num_tiles]
    exp = _scale_exponent(amax)
    # 1/s is a power of two too, so x * (1/s) == x / s exactly (XLA may rewrite a division).
    inv_scale = _pow2_from_exponent(254 - exp)
    inv_scale = jnp.where(exp == 0xFF, jnp.float32(jnp.nan), inv_scale)
    codes = (nope * inv_scale[..., None]).astype(jnp.float8_e4m3fn)
    code_bytes = lax.bitcast_convert_type(codes, jnp.uint8).reshape(*lead, fmt.d_nope)
    rope_bytes = _bf16_to_bytes(k[..., fmt.d_nope :])

    if fmt is KVFormat.V32:
        scale_bits = lax.bitcast_convert_type(_pow2_from_exponent(exp), jnp.uint32)
        scale_bytes = _le_bytes(scale_bits, 4).reshape(*lead, 4 * fmt.num_tiles)
        parts = [code_bytes, scale_bytes, rope_bytes]
    else:
        pad = jnp.zeros((*lead, _MODEL1_SCALE_BYTES - fmt.num_tiles), jnp.uint8)
        parts = [code_bytes, rope_bytes, exp.astype(jnp.uint8), pad]
    return jnp.concatenate(parts, axis=-1)


def dequantize_tokens(rows, fmt=None):
    """Token rows ``[..., bytes_per_token]`` (see :func:`quantize_tokens`) -> bf16 ``[..., d_qk]``.

    ``k = bf16(float(code) * float(bf16(scale)))`` for the NoPE dims (docs/formats.md, "Dequantizing"),
    RoPE copied. A UE8M0 byte ``e`` is ``2 ** (e - 127)`` (255 is NaN).
    """
    fn = "dequantize_tokens"
    rows = jnp.asarray(rows)
    if rows.ndim < 1:
        raise ValueError(f"{fn}: rows must have rank >= 1 [..., bytes_per_token], got a scalar")
    fmt = _resolve_format(fmt, nbytes=rows.shape[-1], who=fn)
    _check_last_dim(rows, fmt.bytes_per_token, "rows", fn, fmt)
    if jnp.dtype(rows.dtype) != jnp.dtype(jnp.uint8):
        if jnp.dtype(rows.dtype) not in CACHE_DTYPES:
            raise TypeError(
                f"{fn}: rows must have dtype uint8, int8 or float8_e4m3fn, "
                f"got {jnp.dtype(rows.dtype).name}"
            )
        rows = lax.bitcast_convert_type(rows, jnp.uint8)
    lead = rows.shape[:-1]

    code_bytes = rows[..., : fmt.d_nope]
    if fmt is KVFormat.V32:
        scale_bytes = rows[..., 512:528].reshape(*lead, fmt.num_tiles, 4)
        scale = lax.bitcast_convert_type(_from_le_bytes(scale_bytes, jnp.uint32), jnp.float32)
        # Any float32 scale is accepted; the kernels round it to bf16 first.
        scale = scale.astype(jnp.bfloat16).astype(jnp.float32)
        rope_bytes = rows[..., 528:656]
    else:
        rope_bytes = rows[..., 448:576]
        # Powers of two (and NaN) are exact in bf16: no rounding step needed.
        scale = _pow2_from_exponent(rows[..., 576 : 576 + fmt.num_tiles])

    codes = lax.bitcast_convert_type(code_bytes, jnp.float8_e4m3fn).astype(jnp.float32)
    codes = codes.reshape(*lead, fmt.num_tiles, fmt.tile_dims)
    nope = (codes * scale[..., None]).astype(jnp.bfloat16).reshape(*lead, fmt.d_nope)
    return jnp.concatenate([nope, _bytes_to_bf16(rope_bytes)], axis=-1)


def rows_to_cache(rows, fmt=None):
    """Token rows ``[num_blocks, page_size, bytes_per_token]`` -> cache bytes (same shape).

    The identity for V32; for MODEL1 it lays each page out as region A then region B.
    """
    rows = jnp.asarray(rows)
    fmt = _resolve_format(fmt, nbytes=rows.shape[-1], who="rows_to_cache")
    if fmt is KVFormat.V32:
        return rows
    nb, ps, nbytes = rows.shape
    region_a = rows[..., :_MODEL1_DATA_BYTES].reshape(nb, ps * _MODEL1_DATA_BYTES)
    region_b = rows[..., _MODEL1_DATA_BYTES:].reshape(nb, ps * _MODEL1_SCALE_BYTES)
    return jnp.concatenate([region_a, region_b], axis=1).reshape(nb, ps, nbytes)


def cache_to_rows(cache, fmt=None):
    """Cache bytes ``[num_blocks, page_size, bytes_per_token]`` -> token rows (inverse of
    :func:`rows_to_cache`)."""
    cache = jnp.asarray(cache)
    fmt = _resolve_format(fmt, nbytes=cache.shape[-1], who="cache_to_rows")
    if fmt is KVFormat.V32:
        return cache
    nb, ps, nbytes = cache.shape
    flat = cache.reshape(nb, ps * nbytes)
    split = ps * _MODEL1_DATA_BYTES
    region_a = flat[:, :split].reshape(nb, ps, _MODEL1_DATA_BYTES)
    region_b = flat[:, split:].reshape(nb, ps, _MODEL1_SCALE_BYTES)
    return jnp.concatenate([region_a, region_b], axis=-1)


# --------------------------------------------------------------------------------------------
# caches


def quantize_kv(k, fmt=None):
    """Quantize a bf16 key cache ``[num_blocks, page_size, d_qk]`` into cache bytes.

    Returns uint8 ``[num_blocks, page_size, bytes_per_token]``, bit-identical to docs/formats.md,
    "Quantizing" (MODEL1 page-planar, padding bytes 0). ``fmt`` (a :class:`KVFormat` or
    ``"V32"``/``"MODEL1"``) defaults to the format of ``k.shape[-1]``; it must be static
    under jit.
    """
    fn = "quantize_kv"
    k = jnp.asarray(k)
    if k.ndim != 3:
        raise ValueError(
            f"{fn}: k must have rank 3 [num_blocks, page_size, d_qk], got rank {k.ndim} "
            f"(shape {tuple(k.shape)})"
        )
    fmt = _resolve_format(fmt, d_qk=k.shape[-1], who=fn)
    _check_bf16(k, "k", fn)
    _check_last_dim(k, fmt.d_qk, "k", fn, fmt)
    return rows_to_cache(quantize_tokens(k, fmt), fmt)


def dequantize_kv(cache, fmt=None):
    """Cache bytes -> bf16 keys ``[num_blocks, page_size, d_qk]`` (docs/formats.md, "Dequantizing").

    ``cache`` is ``[num_blocks, page_size, bytes_per_token]`` or
    ``[num_blocks, page_size, 1, bytes_per_token]``, dtype uint8, int8 or float8_e4m3fn.
    ``fmt`` defaults to the format of the last dim.
    """
    cache, fmt = _as_byte_cache(cache, fmt, "dequantize_kv")
    return dequantize_tokens(cache_to_rows(cache, fmt), fmt)


def write_kv(cache, k_new, slots, fmt=None):
    """Quantize bf16 keys ``k_new [..., d_qk]`` and store them at token ``slots [...]``.

    A slot is ``page * page_size + offset``; slots outside ``[0, num_blocks * page_size)`` are
    dropped, at any integer width (host int64 slots are checked before JAX narrows them; inside
    ``jax.jit`` pass int32 or enable x64, see README). Returns the updated cache with the input's
    shape and dtype. The rows are scattered into the existing buffer (two scatters for MODEL1:
    region A and region B), so under ``jax.jit(..., donate_argnums=0)`` the update happens in
    place. When a slot appears twice which of its rows lands is unspecified. ``fmt`` defaults to
    the format of the cache's last dim.
    """
    fn = "write_kv"
    cache = jnp.asarray(cache)
    fmt = _check_cache(cache.shape, cache.dtype, fmt, fn)
    dtype = cache.dtype
    k_new = jnp.asarray(k_new)
    nb, ps, nbytes = cache.shape[0], cache.shape[1], cache.shape[-1]
    slots = jnp.asarray(_ints.ids(f"{fn}: slots", slots, nb * ps))
    if k_new.ndim < 1:
        raise ValueError(f"{fn}: k_new must have rank >= 1 [n, d_qk], got a scalar")
    _check_bf16(k_new, "k_new", fn)
    _check_last_dim(k_new, fmt.d_qk, "k_new", fn, fmt)
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise TypeError(f"{fn}: slots must have an integer dtype, got {jnp.dtype(slots.dtype).name}")
    if tuple(slots.shape) != tuple(k_new.shape[:-1]):
        raise ValueError(
            f"{fn}: slots shape must equal k_new.shape[:-1] = {tuple(k_new.shape[:-1])}, "
            f"got {tuple(slots.shape)}"
        )

    if ps * nbytes >= 2**31:  # byte positions inside a page are int32
        raise ValueError(f"{fn}: cache pages must be under 2 GiB (page_size * {nbytes} bytes), got page_size={ps}")
    rows = quantize_tokens(k_new.reshape(-1, fmt.d_qk), fmt)  # [n, nbytes] uint8
    if jnp.dtype(dtype) != jnp.dtype(jnp.uint8):
        # Convert the few new rows, not the cache: the cache buffer stays untouched but for the
        # scatter, so a donated cache is updated in place.
        rows = lax.bitcast_convert_type(rows, dtype)
    slots = slots.reshape(-1)
    valid = _in_range(slots, nb * ps)
    # Bad slots go to page `nb`, which the scatter drops.
    page = jnp.where(valid, slots // ps, nb).astype(jnp.int32)
    off = jnp.where(valid, slots % ps, 0).astype(jnp.int32)

    def scatter(c, pos, vals):
        # Byte `pos` of a page sits at [page, pos // nbytes, (0,) pos % nbytes]. Indexing the
        # cache in its own shape avoids a reshape, which for a rank-4 cache costs a copy on CPU.
        idx = (page[:, None], pos // nbytes) + (() if c.ndim == 3 else (0,)) + (pos % nbytes,)
        return c.at[idx].set(vals, mode="drop")

    if fmt is KVFormat.V32:  # token after token
        return scatter(cache, off[:, None] * nbytes + jnp.arange(nbytes), rows)
    # MODEL1: region A record at t * 576, region B record at P * 576 + t * 8.
    data_pos = off[:, None] * _MODEL1_DATA_BYTES + jnp.arange(_MODEL1_DATA_BYTES)
    scale_pos = (
        ps * _MODEL1_DATA_BYTES + off[:, None] * _MODEL1_SCALE_BYTES + jnp.arange(_MODEL1_SCALE_BYTES)
    )
    cache = scatter(cache, data_pos, rows[:, :_MODEL1_DATA_BYTES])
    return scatter(cache, scale_pos, rows[:, _MODEL1_DATA_BYTES:])

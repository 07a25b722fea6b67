"""Cache formats (docs/formats.md): quantize_kv bit for bit against an independent NumPy
implementation, byte layouts, dequantization, write_kv, and argument errors."""

import re
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import formats
from jax_sparse_mla.formats import KVFormat, dequantize_kv, quantize_kv, write_kv
from tests.utils import (
    BF16,
    FP8,
    np_dequantize_kv,
    np_quantize_kv,
    np_quantize_tokens,
    random_keys,
)

V32, MODEL1 = KVFormat.V32, KVFormat.MODEL1
FORMATS = [V32, MODEL1]

_quantize = jax.jit(quantize_kv, static_argnums=1)
_dequantize = jax.jit(dequantize_kv, static_argnums=1)
_write = jax.jit(write_kv, static_argnums=3)


def _bytes(x):
    return np.asarray(x).view(np.uint8)


def _bf16_bits(x):
    return np.asarray(x).view(np.uint16)


def _same_bf16(a, b):
    """Bitwise equality of bf16 arrays, every NaN equal to every NaN."""
    a, b = np.asarray(a), np.asarray(b)
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(_bf16_bits(a)[~nan_a], _bf16_bits(b)[~nan_b]))


def _assert_bytes_equal(got, want):
    got, want = _bytes(got), _bytes(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = np.argwhere(got != want)
    if bad.size:
        first = tuple(bad[0])
        raise AssertionError(f"{len(bad)} bytes differ, first at {bad[:5].tolist()}: "
                             f"got {got[first]}, want {want[first]}")


# ---------------------------------------------------------------------------------------------
# KVFormat


def test_format_properties():
    assert (V32.d_qk, V32.d_nope, V32.d_rope, V32.bytes_per_token) == (576, 512, 64, 656)
    assert (V32.tile_dims, V32.num_tiles, V32.code) == (128, 4, 0)
    assert (MODEL1.d_qk, MODEL1.d_nope, MODEL1.d_rope, MODEL1.bytes_per_token) == (512, 448, 64, 584)
    assert (MODEL1.tile_dims, MODEL1.num_tiles, MODEL1.code) == (64, 7, 1)
    for f in FORMATS:
        assert f.d_nope + f.d_rope == f.d_qk
        assert f.tile_dims * f.num_tiles == f.d_nope
        assert KVFormat.from_d_qk(f.d_qk) is f
        assert KVFormat.from_bytes_per_token(f.bytes_per_token) is f
        assert KVFormat.coerce(f.name) is f and KVFormat.coerce(f.name.lower()) is f
        assert KVFormat.coerce(f) is f
    # MODEL1: 576 region-A bytes + 8 region-B bytes per token
    assert MODEL1.bytes_per_token == 448 + 2 * 64 + 8
    assert V32.bytes_per_token == 512 + 16 + 2 * 64


def test_from_d_qk_error():
    with pytest.raises(ValueError, match=r"d_qk.*\{576, 512\}.*got d_qk=100"):
        KVFormat.from_d_qk(100)
    with pytest.raises(ValueError, match=r"V32.*MODEL1.*'V4'"):
        KVFormat.coerce("V4")
    with pytest.raises(TypeError, match="fmt"):
        KVFormat.coerce(3)


# ---------------------------------------------------------------------------------------------
# quantize_kv, bit for bit


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(3, 1), (2, 61), (1, 64)])
def test_quantize_matches_numpy_random(fmt, shape):
    rng = np.random.default_rng(1000 * fmt.code + 100 * shape[0] + shape[1])
    k = random_keys(rng, fmt.name, *shape)
    _assert_bytes_equal(_quantize(jnp.asarray(k), fmt), np_quantize_kv(k, fmt))


def test_quantize_eager_and_string_format():
    rng = np.random.default_rng(5)
    k = random_keys(rng, "MODEL1", 2, 3)
    want = np_quantize_kv(k, "MODEL1")
    _assert_bytes_equal(quantize_kv(jnp.asarray(k), "MODEL1"), want)
    _assert_bytes_equal(quantize_kv(jnp.asarray(k)), want)  # format from d_qk


def _tiles_to_keys(tiles, fmt, rng):
    """Pack ``[n, tile_dims]`` float32 tiles into bf16 keys ``[n_tokens, 1, d_qk]``."""
    n = -(-tiles.shape[0] // fmt.num_tiles) * fmt.num_tiles
    pad = np.zeros((n - tiles.shape[0], fmt.tile_dims), np.float32)
    nope = np.concatenate([tiles, pad]).reshape(-1, fmt.d_nope)
    rope = rng.standard_normal((nope.shape[0], fmt.d_rope), dtype=np.float32)
    return np.concatenate([nope, rope], axis=-1).astype(BF16)[:, None, :]


def _every_amax_tiles(fmt, rng):
    """One tile per finite bf16 magnitude (zero, subnormals, ..., bf16 max) as the tile's amax,
    with a random sign, the rest of the tile random below it."""
    amax = np.arange(0, 0x7F80, dtype=np.uint16).view(BF16).astype(np.float32)  # 0 .. max finite
    fill = amax[:, None] * rng.uniform(-1, 1, (amax.size, fmt.tile_dims)).astype(np.float32)
    fill = fill.astype(BF16).astype(np.float32)
    where = rng.integers(0, fmt.tile_dims, amax.size)
    sign = np.where(rng.random(amax.size) < 0.5, -1.0, 1.0).astype(np.float32)
    fill[np.arange(amax.size), where] = sign * amax
    return fill


def _fp8_tie_tiles(fmt):
    """Tiles whose codes hit every fp8 value, every midpoint between neighbours (ties to even),
    and the bf16 neighbours of the midpoints; for several scales, including the 1e-4 clamp
    (2**-13) and amax far below it (subnormal codes)."""
    grid = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    mids_bf = mids.astype(BF16)
    up = np.nextafter(mids_bf.astype(np.float32), np.float32(np.inf)).astype(BF16)
    down = np.nextafter(mids_bf.astype(np.float32), np.float32(-np.inf)).astype(BF16)
    vals = np.concatenate([grid, mids, up.astype(np.float64), down.astype(np.float64)])
    vals = np.concatenate([vals, -vals]).astype(np.float32)
    per = fmt.tile_dims - 1
    vals = np.concatenate([vals, np.zeros((-len(vals)) % per, np.float32)]).reshape(-1, per)
    tiles = []
    for k in (-13, -3, 0, 7):  # head 448 * 2**k makes s = 2**k
        head = np.full((vals.shape[0], 1), 448.0 * 2.0**k, np.float32)
        tiles.append(np.concatenate([head, vals * np.float32(2.0**k)], axis=1))
    # amax / 448 below 1e-4: s = 2**-13 from the clamp, codes x / s up to 300
    head = np.full((vals.shape[0], 1), 300.0 * 2.0**-13, np.float32)
    small = np.where(np.abs(vals) <= 300, vals, 0).astype(np.float32) * np.float32(2.0**-13)
    tiles.append(np.concatenate([head, small], axis=1))
    return np.concatenate(tiles)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_every_amax_and_fp8_ties(fmt):
    rng = np.random.default_rng(11)
    tiles = np.concatenate([_every_amax_tiles(fmt, rng), _fp8_tie_tiles(fmt)])
    k = _tiles_to_keys(tiles, fmt, rng)
    assert np.all(np.isfinite(k.astype(np.float32)))
    _assert_bytes_equal(_quantize(jnp.asarray(k), fmt), np_quantize_kv(k, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_scale_boundaries(fmt):
    """amax right at, just below and just above 448 * 2**k and 448e-4: the scale steps exactly
    there, and the stored scale is the expected power of two."""
    rng = np.random.default_rng(3)
    centers = [448.0 * 2.0**k for k in range(-20, 20)] + [448e-4, 0.0448, 1.0, 1.75, 1.7578125]
    bits = np.array(centers, np.float32).astype(BF16).view(np.uint16).astype(np.int64)
    bits = np.unique(np.concatenate([bits - 2, bits - 1, bits, bits + 1, bits + 2]))
    bits = bits[(bits >= 0) & (bits < 0x7F80)]  # non-negative finite bf16 values
    amax = bits.astype(np.uint16).view(BF16).astype(np.float32)
    tiles = np.zeros((amax.size, fmt.tile_dims), np.float32)
    tiles[:, 0] = amax
    fill = amax[:, None] * rng.uniform(-1, 1, (amax.size, fmt.tile_dims - 1))
    tiles[:, 1:] = fill.astype(BF16).astype(np.float32)
    k = _tiles_to_keys(tiles, fmt, rng)
    got = _bytes(_quantize(jnp.asarray(k), fmt))
    _assert_bytes_equal(got, np_quantize_kv(k, fmt))
    # expected scales, from exact rational arithmetic
    from fractions import Fraction

    rows = got[:, 0, :]  # with page_size 1 the MODEL1 planar layout is the token row
    for i, a in enumerate(amax):
        y = max(Fraction(float(np.float32(a) / np.float32(448.0))), Fraction(float(np.float32(1e-4))))
        e = -200
        while Fraction(2) ** e < y:
            e += 1
        tok, tile = divmod(i, fmt.num_tiles)
        if fmt is V32:
            s = rows[tok, 512 + 4 * tile: 516 + 4 * tile].view("<f4")[0]
            assert s == np.float32(2.0**e), (a, s, e)
        else:
            assert rows[tok, 576 + tile] == e + 127, (a, rows[tok, 576 + tile], e)


# ---------------------------------------------------------------------------------------------
# byte layouts


def test_v32_layout():
    rng = np.random.default_rng(7)
    k = random_keys(rng, "V32", 2, 5)
    c = _bytes(_quantize(jnp.asarray(k), V32))
    assert c.shape == (2, 5, 656) and c.dtype == np.uint8
    x = k.astype(np.float32)
    for p in range(2):
        for t in range(5):
            tok = c[p, t]
            scales = tok[512:528].view("<f4")
            codes = tok[:512].view(FP8).astype(np.float32)
            for j in range(4):
                s = scales[j]
                m, _ = np.frexp(s)
                assert m == 0.5, f"scale {s} is not a power of two"
                amax = np.abs(x[p, t, 128 * j:128 * j + 128]).max()
                assert s >= np.float32(amax) / np.float32(448) and s >= np.float32(2.0**-13)
                assert s == np.float32(2.0**-13) or s / 2 < np.float32(amax) / np.float32(448)
                np.testing.assert_allclose(codes[128 * j:128 * j + 128] * s, x[p, t, 128 * j:128 * j + 128],
                                           rtol=2**-4, atol=float(s) * 2**-10)
            assert np.array_equal(tok[528:656].view("<u2"), _bf16_bits(k[p, t, 512:]))


@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_model1_planar_layout(page_size):
    rng = np.random.default_rng(page_size)
    nb = 2
    k = random_keys(rng, "MODEL1", nb, page_size)
    c = _bytes(_quantize(jnp.asarray(k), MODEL1))
    assert c.shape == (nb, page_size, 584)
    rows = np_quantize_tokens(k, "MODEL1")  # [nb, P, 584] logical token rows
    x = k.astype(np.float32)
    P = page_size
    for p in range(nb):
        page = c[p].reshape(-1)  # P * 584 bytes
        for t in range(P):
            data = page[t * 576:(t + 1) * 576]
            scale = page[P * 576 + t * 8:P * 576 + t * 8 + 8]
            assert np.array_equal(data, rows[p, t, :576])
            assert np.array_equal(scale, rows[p, t, 576:])
            assert scale[7] == 0, "padding byte must be 0"
            assert np.array_equal(data[448:576].view("<u2"), _bf16_bits(k[p, t, 448:]))
            codes = data[:448].view(FP8).astype(np.float32).reshape(7, 64)
            s = np.ldexp(np.float32(1), scale[:7].astype(np.int32) - 127).astype(np.float32)
            np.testing.assert_allclose(codes * s[:, None], x[p, t, :448].reshape(7, 64),
                                       rtol=2**-4, atol=float(s.max()) * 2**-10)


# ---------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip(fmt):
    rng = np.random.default_rng(21)
    k = random_keys(rng, fmt.name, 3, 61)
    c = _quantize(jnp.asarray(k), fmt)
    d = _dequantize(c, fmt)
    assert d.shape == k.shape and d.dtype == jnp.bfloat16
    assert _same_bf16(d, np_dequantize_kv(np.asarray(c), fmt.name))

    # within fp8 precision: 3 mantissa bits (rel 2**-4), subnormal step s * 2**-9, bf16 rounding
    x = k.astype(np.float32)
    rows = np_quantize_tokens(k, fmt.name)
    if fmt is V32:
        s = np.ascontiguousarray(rows[..., 512:528]).view("<f4")
    else:
        s = np.ldexp(np.float32(1), rows[..., 576:583].astype(np.int32) - 127).astype(np.float32)
    s_dim = np.repeat(s, fmt.tile_dims, axis=-1)
    err = np.abs(np.asarray(d, np.float32)[..., :fmt.d_nope] - x[..., :fmt.d_nope])
    bound = np.abs(x[..., :fmt.d_nope]) * (2**-4 + 2**-8) + s_dim * 2**-10
    assert np.all(err <= bound), float((err - bound).max())
    assert np.array_equal(_bf16_bits(np.asarray(d)[..., fmt.d_nope:]), _bf16_bits(k[..., fmt.d_nope:]))

    # requantizing the dequantized keys: same values always; same bytes unless a tile's largest
    # code is 224 (amax/s in (224, 232) rounds down, and then the scale halves: codes double)
    c2 = _quantize(d, fmt)
    assert _same_bf16(_dequantize(c2, fmt), d)
    rows1, rows2 = np_quantize_tokens(k, fmt.name), np_quantize_tokens(np.asarray(d), fmt.name)
    codes = np.abs(rows1[..., :fmt.d_nope].view(FP8).astype(np.float32))
    max_code = codes.reshape(*codes.shape[:-1], fmt.num_tiles, fmt.tile_dims).max(-1)
    stable = np.all(max_code != 224, axis=-1)  # tokens without such a tile
    assert stable.mean() > 0.5
    assert np.array_equal(rows1[stable], rows2[stable])
    _assert_bytes_equal(c2, np_quantize_kv(np.asarray(d), fmt.name))


def _v32_cache_with_scales(rng, scales):
    """V32 cache [n, 1, 656] with random codes and the given float32 scales [n, 4]."""
    n = scales.shape[0]
    c = np.zeros((n, 1, 656), np.uint8)
    codes = rng.integers(0, 256, (n, 512), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    c[:, 0, :512] = codes
    c[:, 0, 512:528] = scales.astype("<f4").view(np.uint8)
    c[:, 0, 528:] = rng.standard_normal((n, 64), dtype=np.float32).astype(BF16).view(np.uint8)
    return c


def test_dequantize_v32_arbitrary_scales():
    """Non-power-of-two float32 scales (other producers): the scale is rounded to bf16 first."""
    rng = np.random.default_rng(9)
    scales = (rng.uniform(0.5, 2.0, (64, 4)) * 10.0 ** rng.integers(-6, 4, (64, 4))).astype(np.float32)
    c = _v32_cache_with_scales(rng, scales)
    got = np.asarray(_dequantize(jnp.asarray(c), V32))
    want = np_dequantize_kv(c, "V32")
    assert _same_bf16(got, want)
    # the bf16 rounding of the scale matters: without it the result differs somewhere
    codes = c[:, 0, :512].view(FP8).astype(np.float32).reshape(64, 4, 128)
    unrounded = (codes * scales[:, :, None]).astype(BF16).reshape(64, 1, 512)
    assert not _same_bf16(got[..., :512], unrounded)
    # spot check of the formula for one element
    i, j = 3, 200
    s_bf = np.float32(scales[i, j // 128]).astype(BF16).astype(np.float32)
    assert got[i, 0, j] == (codes[i, j // 128, j % 128] * s_bf).astype(BF16)


def test_dequantize_special_bytes():
    # MODEL1: scale byte 255 is NaN, byte 0 is 2**-127, 127 is 1; fp8 0x7F / 0xFF are NaN
    c = np.zeros((1, 1, 584), np.uint8)
    c[0, 0, :448] = 0x38  # 1.0
    c[0, 0, 1] = 0x7F
    c[0, 0, 2] = 0xFF
    c[0, 0, 3] = 0xB8  # -1.0
    c[0, 0, 576:583] = [127, 255, 0, 130, 1, 254, 100]
    d = np.asarray(_dequantize(jnp.asarray(c), MODEL1), np.float32)[0, 0]
    assert np.isnan(d[1]) and np.isnan(d[2]) and d[0] == 1.0 and d[3] == -1.0
    assert np.all(np.isnan(d[64:128]))
    assert np.all(d[128:192] == np.float32(2.0**-127)) or np.all(d[128:192] == 0.0)  # FTZ allowed
    assert np.all(d[192:256] == 8.0) and np.all(d[256:320] == np.float32(2.0**-126))
    assert np.all(d[320:384] == np.float32(2.0**127)) and np.all(d[384:448] == np.float32(2.0**-27))
    # V32: a NaN scale poisons its tile only
    c = np.zeros((1, 1, 656), np.uint8)
    c[0, 0, :512] = 0x38
    c[0, 0, 512:528] = np.array([1.0, np.nan, 0.5, 3.0], "<f4").view(np.uint8)
    d = np.asarray(_dequantize(jnp.asarray(c), V32), np.float32)[0, 0]
    assert np.all(d[:128] == 1) and np.all(np.isnan(d[128:256]))
    assert np.all(d[256:384] == 0.5) and np.all(d[384:512] == 3.0)


CXX = shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_native_ue8m0_decode_of_every_byte(tmp_path):
    """The C++ decode of a UE8M0 byte (ffi/common/kv_format.h: the CPU handlers, and the GPU
    kernels' table of all 256 values) is branch-free bit arithmetic; each byte against the format:
    2^(e - 127), with byte 0 the float32 subnormal 2^-127 and byte 255 NaN."""
    root = Path(__file__).resolve().parent.parent
    program = tmp_path / "ue8m0.cc"
    program.write_text(
        '#include <cstdio>\n#include "common/kv_format.h"\n'
        "int main() { for (int e = 0; e < 256; ++e) { float f = jsm::ue8m0_to_float(static_cast<uint8_t>(e));"
        ' unsigned u; std::memcpy(&u, &f, 4); std::printf("%08x\\n", u); } }\n')
    done = subprocess.run([CXX, "-std=c++17", f"-I{root / 'ffi'}", str(program), "-o", str(tmp_path / "ue8m0")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = subprocess.run([str(tmp_path / "ue8m0")], capture_output=True, text=True, check=True).stdout.split()
    got = np.array([int(w, 16) for w in out], np.uint32).view(np.float32)
    assert got.shape == (256,)
    assert np.isnan(got[255])
    want = np.ldexp(np.float64(1.0), np.arange(255) - 127)  # exact in float32, 2^-127 as a subnormal
    assert np.array_equal(got[:255].astype(np.float64), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_input_variants(fmt):
    """uint8, int8, float8_e4m3fn and the rank-4 FlashMLA shape hold the same bytes."""
    rng = np.random.default_rng(4)
    c = _quantize(jnp.asarray(random_keys(rng, fmt.name, 2, 5)), fmt)
    want = np.asarray(_dequantize(c, fmt))
    for v in (c[:, :, None, :], jax.lax.bitcast_convert_type(c, jnp.int8),
              jax.lax.bitcast_convert_type(c, jnp.float8_e4m3fn)[:, :, None, :]):
        assert _same_bf16(dequantize_kv(v, fmt), want)
        assert _same_bf16(dequantize_kv(v), want)  # format from the byte count


# ---------------------------------------------------------------------------------------------
# write_kv


def _write_case(fmt, num_blocks, page_size, n, seed):
    rng = np.random.default_rng(seed)
    k0 = random_keys(rng, fmt.name, num_blocks, page_size)
    num_tokens = num_blocks * page_size
    k_new = random_keys(rng, fmt.name, 1, n)[0]
    slots = rng.choice(num_tokens, n, replace=False).astype(np.int64)
    bad = np.array([-1, -2**31, num_tokens, num_tokens + 5, 2**31 - 1])
    slots[:len(bad)] = bad
    slots = slots.astype(np.int32)
    expected = k0.reshape(num_tokens, -1).copy()
    ok = (slots >= 0) & (slots < num_tokens)
    expected[slots[ok]] = k_new[ok]
    return k0, k_new, slots, np_quantize_kv(expected.reshape(k0.shape), fmt.name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [1, 61])
def test_write_kv_matches_whole_cache_quantize(fmt, page_size):
    k0, k_new, slots, want = _write_case(fmt, 9, page_size, 8, page_size)
    cache = jnp.asarray(np_quantize_kv(k0, fmt.name))
    got = _write(cache, jnp.asarray(k_new), jnp.asarray(slots), fmt)
    assert got.shape == cache.shape and got.dtype == jnp.uint8
    _assert_bytes_equal(got, want)
    # eager, format inferred, 2-D slots
    got = write_kv(cache, jnp.asarray(k_new).reshape(2, 4, -1), jnp.asarray(slots).reshape(2, 4))
    _assert_bytes_equal(got, want)


def _copy_sizes(hlo_text):
    """Element counts of every `copy` instruction's result in compiled HLO text."""
    sizes = []
    for line in hlo_text.splitlines():
        m = re.search(r"=\s*\w+\[([\d,]*)\][^=]*\bcopy\(", line)
        if m:
            dims = [int(v) for v in m.group(1).split(",") if v]
            sizes.append(int(np.prod(dims)) if dims else 1)
    return sizes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", ["uint8", "rank4", "int8", "float8"])
def test_write_kv_donated(fmt, variant):
    """Under jit with the cache donated: right bytes, same shape and dtype, the input buffer is
    consumed, and the compiled program never copies the whole cache."""
    page_size = 61 if variant in ("uint8", "float8") else 1
    k0, k_new, slots, want = _write_case(fmt, 7, page_size, 6, 99)

    def make():
        c = jnp.asarray(np_quantize_kv(k0, fmt.name))
        if variant == "rank4":
            c = c[:, :, None, :]
        elif variant == "int8":
            c = jax.lax.bitcast_convert_type(c, jnp.int8)
        elif variant == "float8":
            c = jax.lax.bitcast_convert_type(c, jnp.float8_e4m3fn)[:, :, None, :]
        return c

    cache = make()
    shape, dtype = cache.shape, cache.dtype
    f = jax.jit(write_kv, donate_argnums=0, static_argnums=3)
    compiled = f.lower(cache, k_new, slots, fmt).compile().as_text()
    assert "input_output_alias" in compiled
    assert all(s < cache.size for s in _copy_sizes(compiled)), "write_kv copies the whole cache"
    got = f(cache, jnp.asarray(k_new), jnp.asarray(slots), fmt)
    assert cache.is_deleted(), "the donated cache was not consumed"
    assert got.shape == shape and got.dtype == dtype
    _assert_bytes_equal(np.asarray(got).view(np.uint8).reshape(want.shape), want)
    # a second step on the result (the usual decode loop)
    got2 = f(got, jnp.asarray(k_new[::-1]), jnp.asarray(slots), fmt)
    assert got2.shape == shape


def test_write_kv_keeps_nan_bytes_elsewhere():
    """0xFF bytes of other slots (also in the float8 dtype) pass through untouched."""
    c = np.full((3, 4, 584), 0xFF, np.uint8)
    k = random_keys(np.random.default_rng(0), "MODEL1", 1, 1)[0]
    cache = jax.lax.bitcast_convert_type(jnp.asarray(c), jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(write_kv)(cache, jnp.asarray(k), jnp.array([5], jnp.int32))).view(np.uint8)
    want = c.reshape(3, -1).copy()
    row = np_quantize_tokens(k, "MODEL1")[0]
    want[1, 576:1152] = row[:576]
    want[1, 4 * 576 + 8:4 * 576 + 16] = row[576:]
    _assert_bytes_equal(got, want.reshape(3, 4, 584))


# ---------------------------------------------------------------------------------------------
# errors


def test_errors():
    k = jnp.zeros((2, 3, 576), jnp.bfloat16)
    with pytest.raises(TypeError, match=r"quantize_kv: k must have dtype bfloat16, got float32"):
        quantize_kv(k.astype(jnp.float32), V32)
    with pytest.raises(ValueError, match=r"quantize_kv: k last dim must be 512 for format MODEL1, got 576"):
        quantize_kv(k, MODEL1)
    with pytest.raises(ValueError, match=r"quantize_kv: k must have rank 3.*got rank 2"):
        quantize_kv(k[0], V32)
    with pytest.raises(ValueError, match=r"d_qk.*got d_qk=100"):
        quantize_kv(jnp.zeros((1, 1, 100), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"'V33'"):
        quantize_kv(k, "V33")

    c = jnp.zeros((2, 3, 656), jnp.uint8)
    with pytest.raises(TypeError, match=r"dequantize_kv: cache must have dtype uint8, int8 or "
                                        r"float8_e4m3fn.*got float32"):
        dequantize_kv(c.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"dequantize_kv: cache last dim .* must be 584 for "
                                         r"format MODEL1, got 656"):
        dequantize_kv(c, MODEL1)
    with pytest.raises(ValueError, match=r"bytes_per_token.*\{656, 584\}.*got 600"):
        dequantize_kv(jnp.zeros((2, 3, 600), jnp.uint8))
    with pytest.raises(ValueError, match=r"rank-4 cache.*dim 2 must be 1"):
        dequantize_kv(jnp.zeros((2, 3, 2, 656), jnp.uint8))
    with pytest.raises(ValueError, match=r"rank 3 .* got rank 2"):
        dequantize_kv(jnp.zeros((3, 656), jnp.uint8))

    kn = jnp.zeros((4, 576), jnp.bfloat16)
    slots = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"write_kv: slots shape must equal "
                                         r"k_new.shape\[:-1\] = \(4,\), got \(3,\)"):
        write_kv(c, kn, slots[:3])
    with pytest.raises(TypeError, match=r"write_kv: slots must have an integer dtype, got float32"):
        write_kv(c, kn, slots.astype(jnp.float32))
    with pytest.raises(TypeError, match=r"write_kv: k_new must have dtype bfloat16, got float32"):
        write_kv(c, kn.astype(jnp.float32), slots)
    with pytest.raises(ValueError, match=r"write_kv: k_new last dim must be 576 for format V32, "
                                         r"got 512"):
        write_kv(c, jnp.zeros((4, 512), jnp.bfloat16), slots)
    with pytest.raises(TypeError, match=r"write_kv: cache must have dtype"):
        write_kv(c.astype(jnp.int32), kn, slots)
    huge = jax.ShapeDtypeStruct((1, 3_300_000, 656), jnp.uint8)  # traced only, never allocated
    with pytest.raises(ValueError, match=r"write_kv: cache pages must be under 2 GiB .* got page_size=3300000"):
        jax.eval_shape(write_kv, huge, kn, slots)


def test_quantize_tokens_and_rows_helpers():
    rng = np.random.default_rng(1)
    k = random_keys(rng, "MODEL1", 3, 5)
    rows = np.asarray(formats.quantize_tokens(jnp.asarray(k), "MODEL1"))
    assert np.array_equal(rows, np_quantize_tokens(k, "MODEL1"))
    cache = formats.rows_to_cache(jnp.asarray(rows), "MODEL1")
    assert np.array_equal(np.asarray(formats.cache_to_rows(cache, "MODEL1")), rows)
    assert _same_bf16(formats.dequantize_tokens(jnp.asarray(rows), "MODEL1"), dequantize_kv(cache))

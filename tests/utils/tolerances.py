"""The tolerances (docs/numerics.md, Tolerances) and the assertions that apply them."""

from __future__ import annotations

import numpy as np


OUT_ATOL = 1e-3
OUT_RTOL = 2.01 / 128
OUT_COS_DIFF = 5e-6
LSE_ATOL = 1e-6
LSE_RTOL = 8.01 / 65536


def _as_f64(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float64)


def _worst(a, r, bad, limit=5):
    """Text listing up to ``limit`` failing elements, largest error first."""
    idx = np.argwhere(bad)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - r)[bad]
    err = np.where(np.isnan(err), np.inf, err)
    order = np.argsort(-err, kind="stable")[:limit]
    lines = []
    for k in order:
        pos = tuple(int(v) for v in idx[k])
        lines.append(f"    at {pos}: actual={a[pos]!r} expected={r[pos]!r} |diff|={err[k]:.3g}")
    return "\n".join(lines)


def out_of_tolerance(a, r, atol, rtol):
    """Elementwise tolerance rule on float64 arrays: the mask of elements failing
    ``|a-r| <= atol or <= rtol*|r|`` (infinities must match, NaN never passes)."""
    nan = np.isnan(a) | np.isnan(r)
    inf = np.isinf(a) | np.isinf(r)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - r)
        close = (diff <= atol) | (diff <= rtol * np.abs(r))
    return ~(np.where(inf, a == r, close) & ~nan)


def _elementwise(actual, ref, atol, rtol, what):
    a, r = _as_f64(actual), _as_f64(ref)
    if a.shape != r.shape:
        raise AssertionError(f"{what}: shape mismatch, actual {a.shape} vs expected {r.shape}")
    bad = out_of_tolerance(a, r, atol, rtol)
    if bad.any():
        nan = np.isnan(a) | np.isnan(r)
        inf = np.isinf(a) | np.isinf(r)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.size} elements out of tolerance "
            f"(|diff| <= {atol:g} or <= {rtol:.6g}*|expected|; infinities must match; NaN never "
            f"passes; {int((nan & bad).sum())} NaN, {int((inf & bad).sum())} inf mismatches). "
            f"Worst:\n{_worst(a, r, bad)}"
        )
    return a, r, np.isinf(a) | np.isinf(r)


def cosine_difference(a, r) -> float:
    """``1 - 2*sum(a*r)/sum(a^2+r^2)`` in float64 (0 for two all-zero arrays)."""
    a, r = _as_f64(a).ravel(), _as_f64(r).ravel()
    denom = float(np.sum(a * a + r * r))
    return 0.0 if denom == 0.0 else 1.0 - 2.0 * float(np.sum(a * r)) / denom


def _assert_out_within(actual, ref, scale):
    """``out``'s rule with every bound scaled: elementwise ``scale`` x (atol, rtol), cosine
    difference under ``scale^2`` x 5e-6 (float64, over the finite elements)."""
    a, r, inf = _elementwise(actual, ref, scale * OUT_ATOL, scale * OUT_RTOL, "out")
    a, r = a[~inf], r[~inf]
    cos_diff = cosine_difference(a, r)
    bound = scale * scale * OUT_COS_DIFF
    if not cos_diff < bound:
        raise AssertionError(
            f"out: whole-tensor cosine difference {cos_diff:.3g} >= {bound:g} "
            f"(max |diff| {float(np.max(np.abs(a - r), initial=0.0)):.3g})"
        )


def assert_out_close(actual, ref):
    """Tolerance check of ``out``: elementwise tolerance plus the whole-tensor
    ``1 - 2*sum(a*r)/sum(a^2+r^2) < 5e-6`` (float64, over the finite elements)."""
    _assert_out_within(actual, ref, 1)


def assert_out_agree(actual, other):
    """Two outputs of the op that each meet ``assert_out_close`` against the reference (the same
    kernel on two plans: other split points, so other roundings) are held to what that implies
    for each other, not to the reference's tolerance itself. By the triangle inequality they agree
    within twice the elementwise bounds; the square root of the cosine difference is, to first
    order, a distance (``sqrt(cd(a, b)) ~ |a - b| / (sqrt(2) |b|)``), so theirs is below
    ``(2 sqrt(5e-6))^2 = 4 * 5e-6``. A missing or extra block of entries is orders of magnitude
    beyond either bound."""
    _assert_out_within(actual, other, 2)


def assert_lse_close(actual, ref):
    """Tolerance check of ``lse``: ``|a-r| <= 1e-6`` or ``<= 8.01/65536*|r|``, infinities
    equal, NaN fails."""
    _elementwise(actual, ref, LSE_ATOL, LSE_RTOL, "lse")


def assert_lse_shifted(actual, base, shift):
    """``actual == base + shift`` for two lse of the same kernel (e.g. duplicated entries:
    ``shift = log 2``), tighter than `assert_lse_close`: ``rtol=1e-5`` with the absolute floor
    ``LSE_ATOL``. The floor is needed because lse's float32 rounding is absolute (its terms are
    of order 1): seed 2348557472 put an lse at 6e-5, off by 1.2e-7."""
    np.testing.assert_allclose(np.asarray(actual), np.asarray(base) + shift, rtol=1e-5, atol=LSE_ATOL)

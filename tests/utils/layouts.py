"""Multi-device layouts, and the collectives of compiled programs."""

from __future__ import annotations

import math
import re


_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
                         r"(?:-start)?\(")


def collectives(hlo: str, min_elements: int = 0) -> list[str]:
    """The collective instructions of a compiled program (``compiled.as_text()``) whose result
    holds an array of at least ``min_elements`` elements (0: every collective; a cache's size:
    the cache, or a reshape of it, moved between devices). Async ``*-start`` forms count."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", m.group(1))]
        if max(sizes, default=1) >= min_elements:
            found.append(line.strip())
    return found


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit``."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def mesh_layouts(n: int, heads: int) -> dict:
    """(dp, tp) of the multi-device layouts on ``n`` devices: ``"tp"`` heads split over all of
    them (as far as ``heads`` divides), ``"dp"`` requests split ``n`` ways, and ``"dp2_tp"``
    DP 2 x TP n/2 (same caveat; only for an even ``n >= 4``)."""
    layouts = {"tp": (1, largest_divisor(heads, n)), "dp": (n, 1)}
    if n >= 4 and n % 2 == 0:
        layouts["dp2_tp"] = (2, largest_divisor(heads, n // 2))
    return layouts

"""Where a traced stretch of GPU time goes: kernel times and the gaps between them.

`bench` records one more repetition of each timed path with `jax.profiler.trace` (under
`--trace DIR`, else in a temporary directory) and reads the Perfetto trace back here. The
device's events (processes named "/device:...") give, per kernel name, how often it ran and for
how long, and over the whole stretch its span (first kernel start to last kernel end: bench's
device µs, once divided by the calls in the stretch) and how much of it some kernel was running
("busy") versus idle between kernels. Host events (dispatch, sync) are not counted.
"""

from __future__ import annotations

import glob
import gzip
import json
import os


def latest_trace_file(trace_dir: str) -> str | None:
    """The newest perfetto_trace.json.gz that jax.profiler.trace wrote under `trace_dir`."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def _busy_us(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


def summarize_events(events) -> dict:
    """Device-side summary of Chrome/Perfetto trace events (timestamps in µs).

    Returns {"kernels": {name: {"count", "total_us"}}, "span_us", "busy_us", "idle_us"};
    span = first device event start to last end. Host events are ignored; with no
    device events the counts are zero.
    """
    device_pids = {e["pid"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    kernels: dict[str, dict] = {}
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        intervals.append((start, start + dur))
        k = kernels.setdefault(e["name"], {"count": 0, "total_us": 0.0})
        k["count"] += 1
        k["total_us"] += dur
    if not intervals:
        return {"kernels": {}, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0}
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = _busy_us(intervals)
    return {"kernels": kernels, "span_us": span, "busy_us": busy, "idle_us": span - busy}


def summarize_file(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return summarize_events(trace["traceEvents"] if isinstance(trace, dict) else trace)


def format_summary(summary: dict, calls: int, top: int = 6) -> str:
    """A few lines: per-call span/busy/idle and the longest kernels (µs per call)."""
    if not summary["kernels"]:
        return "trace: no device events (CPU backend, or the profiler saw no GPU)"
    per = max(calls, 1)
    lines = [f"trace: per call {summary['span_us'] / per:.1f} µs of device span, "
             f"{summary['busy_us'] / per:.1f} busy, {summary['idle_us'] / per:.1f} idle"]
    ranked = sorted(summary["kernels"].items(), key=lambda kv: -kv[1]["total_us"])
    for name, k in ranked[:top]:
        lines.append(f"  {k['total_us'] / per:9.1f} µs/call  {k['count']:5d}x  {name[:90]}")
    return "\n".join(lines)

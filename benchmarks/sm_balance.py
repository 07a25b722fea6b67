"""How evenly a kernel's CTAs end, ours and FlashMLA's, from one ncu log (stage `balance` of
device_run.sh: both libraries on the same inputs, side_by_side.py).

    python3 benchmarks/sm_balance.py LOG SHAPE   ->   one BALANCE line per kernel name

Both decode kernels run one CTA per SM, so an SM's active cycles are its CTA's life. Per kernel,
medians over its launches (the first quarter dropped as warm-up) of: the duration, the elapsed
cycles (the launch's length), and the SMs' active cycles: the longest (the kernel's end), the
mean over all SMs, the shortest. `end/mean` is how far the slowest CTA is behind a typical one
(idle or early-exiting CTAs pull the mean down: our 33rd worker at b = 64 and 128 is 4 of 132
SMs, ~3%); `outside` is the elapsed cycles no CTA covers (launch and drain).
"""
import collections
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_times import TO_US  # noqa: E402

# A launch header: "  void jsm::cuda::decode_kernel<...>(jsm::cuda::Params) (132, 1, 1)x(384, 1, 1), Context 1, ..."
HEADER = re.compile(r"^\s*(?:void\s+)?([^<(\s]+).*\)x\(")
METRIC = re.compile(r"^\s*([a-z_]+__[\w.]+)\s+(\S+)\s+([\d.,]+)\s*$")
# The SMs' active cycles are needed; the duration and the elapsed cycles are read when there.
NEEDED = ("sm__cycles_active.max", "sm__cycles_active.avg", "sm__cycles_active.min")
METRICS = ("gpu__time_duration.sum", "gpc__cycles_elapsed.max") + NEEDED


def launches(lines):
    """Each launch's metrics, by kernel name (the name without namespaces or template)."""
    found, current = collections.defaultdict(list), None
    for line in lines:
        if m := HEADER.match(line.replace("<unnamed>", "")):
            current = {}
            found[m.group(1).split("::")[-1]].append(current)
        elif (m := METRIC.match(line)) and current is not None and m.group(1) in METRICS:
            value = float(m.group(3).replace(",", ""))
            if m.group(1) == "gpu__time_duration.sum":
                value *= TO_US[m.group(2)]
            current[m.group(1)] = value
    return {name: [r for r in runs if all(k in r for k in NEEDED)] for name, runs in found.items()}


def _median(kept, value):
    """The median of value(launch) over the launches that have what it reads (None: none has)."""
    got = []
    for r in kept:
        try:
            got.append(value(r))
        except KeyError:
            pass
    return statistics.median(got) if got else None


def balance(runs):
    """Medians over the launches after the first quarter, and the ratios read from them."""
    kept = runs[len(runs) // 4:] or runs
    return dict(launches=len(runs), us=_median(kept, lambda r: r["gpu__time_duration.sum"]),
                elapsed=_median(kept, lambda r: r["gpc__cycles_elapsed.max"]),
                end=_median(kept, lambda r: r["sm__cycles_active.max"]),
                mean=_median(kept, lambda r: r["sm__cycles_active.avg"]),
                shortest=_median(kept, lambda r: r["sm__cycles_active.min"]),
                end_over_mean=_median(kept, lambda r: r["sm__cycles_active.max"] / r["sm__cycles_active.avg"]),
                outside=_median(kept, lambda r: r["gpc__cycles_elapsed.max"] - r["sm__cycles_active.max"]))


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def lines_for(log, shape):
    out = []
    for name, runs in sorted(launches(log).items()):
        if not runs:
            out.append(f"BALANCE {shape} {name}: no launch with all of {', '.join(NEEDED)}")
            continue
        b = balance(runs)
        out.append(f"BALANCE {shape} {name}: {b['launches']} launches, {_fmt(b['us'], '.1f')} us, "
                   f"{_fmt(b['elapsed'], '.0f')} cycles; SM active end {b['end']:.0f} / mean {b['mean']:.0f} / "
                   f"shortest {b['shortest']:.0f}; end/mean {b['end_over_mean']:.4f}; "
                   f"outside {_fmt(b['outside'], '.0f')}")
    return out or [f"BALANCE {shape}: no launches found"]


if __name__ == "__main__":
    print("\n".join(lines_for(open(sys.argv[1]), sys.argv[2])))

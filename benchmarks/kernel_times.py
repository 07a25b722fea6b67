"""Our decode + combine kernel time per call from an ncu log (one counter: gpu__time_duration.sum).

    python3 benchmarks/kernel_times.py LOG SHAPE   ->   KTIME SHAPE ours X us (ours alone)

The median of each kernel after dropping the first quarter of its launches (warm-up), summed over
the decode and combine kernels: the figure ktime.sh gives for our side, for runs without FlashMLA.
A plan that cuts no request runs no combine, so a log with one decode kernel and no combine is whole.
"""
import collections
import re
import statistics
import sys

# A launch header: "  void jsm::decode_kernel_small<0, 16, 1>(jsm::Params) (132, 1, 1)x(512, 1, 1), ..."
KERNEL = re.compile(r"(decode_kernel\w*|combine_kernel).*\)x\(")
DURATION = re.compile(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)")
TO_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3}


def kernel_medians(lines):
    times, name = collections.defaultdict(list), None
    for line in lines:
        if m := KERNEL.search(line):
            name = m.group(1)
        elif (m := DURATION.search(line)) and name:
            times[name].append(float(m.group(2).replace(",", "")) * TO_US[m.group(1)])
            name = None
    return {k: statistics.median(v[len(v) // 4:] or v) for k, v in times.items()}


if __name__ == "__main__":
    med = kernel_medians(open(sys.argv[1]))
    decode_kernels = [k for k in med if k.startswith("decode_kernel")]
    if len(decode_kernels) == 1 and len(med) <= 2:
        print(f"KTIME {sys.argv[2]} ours {sum(med.values()):.1f} us (ours alone: "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + ")")
    else:
        print(f"KTIME {sys.argv[2]} incomplete: {med} (see {sys.argv[1]})")

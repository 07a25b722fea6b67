"""Where a warp-specialized kernel's time goes, role by role, from ncu's source counters.

`device_run.sh` stage `ncu` leaves `ncu_source.csv` (one SASS line a row, with instruction
counts and warp-stall samples). The roles of decode_kernel_rs / decode_kernel start at their
`setmaxnreg` (USETMAXREG), so the SASS is split there: region 1 is the code after the first
USETMAXREG, and so on (decode_kernel_rs: 1 = warpgroup A, 2 = B, 3 = the producer, plus any
out-of-line code the compiler put at the end).

    python3 benchmarks/ncu_roles.py ncu_source.csv                 # instructions, top stalls per region
    python3 benchmarks/ncu_roles.py ncu_source.csv --hot 1 --blocks 8192 --warps 4   # region 1's hottest lines
    python3 benchmarks/ncu_roles.py ncu_source.csv --counts --blocks 2560 --warps 4  # by how often a line runs
    python3 benchmarks/ncu_roles.py ncu_source.csv --opcode MUFU   # what the MUFU lines of each region wait for

--counts groups each region's lines by how many times a warp runs them a block (with --blocks
and --warps right: ~1 or more = every block, 1 / blocks-a-request = once a request, and so on),
so that code run once a piece or a CTA shows its share of the samples. --opcode sums the
stall samples of the lines whose instruction starts with that opcode (`MUFU`: the softmax's
exponentials), region by region, and says what share of the region's samples they hold.
"""
import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sass_text import by_region, opcode_of  # noqa: E402


def read(path):
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    return header, [r for r in rows[start + 1:] if len(r) >= len(header)]


def source(row):
    """A CSV row's SASS text (its Source column)."""
    return row[1]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--hot", type=int, help="list this region's lines with the most stall samples")
    ap.add_argument("--top", type=int, default=30, help="how many lines --hot lists")
    ap.add_argument("--blocks", type=float, default=1.0, help="divide instruction counts by this (blocks)")
    ap.add_argument("--warps", type=float, default=1.0, help="and by this (warps a role)")
    ap.add_argument("--counts", action="store_true", help="group each region's lines by their count a block")
    ap.add_argument("--opcode", help="the stall reasons of the lines with this opcode (e.g. MUFU), per region")
    args = ap.parse_args()
    header, rows = read(args.csv)
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    per = args.blocks * args.warps
    if args.counts:
        print_counts(rows, col, per)
        return
    if args.opcode:
        print_opcode(rows, col, stalls, args.opcode)
        return
    totals, lines = {}, []
    for region, r in by_region(rows, sass=source):
        t = totals.setdefault(region, {"instr": 0.0, "samples": 0.0, **{s: 0.0 for s in stalls}})
        t["instr"] += number(r[col["Instructions Executed"]])
        samples = number(r[col["Warp Stall Sampling (All Samples)"]])
        t["samples"] += samples
        for s in stalls:
            t[s] += number(r[col[s]])
        if region == args.hot:
            top = sorted(((number(r[col[s]]), s) for s in stalls), reverse=True)[:2]
            lines.append((samples, number(r[col["Instructions Executed"]]) / per, r[1].strip(), top))
    if args.hot is None:
        for k, t in totals.items():
            print(f"region {k}: instructions {t['instr'] / per:.4g}, samples {t['samples']:.0f} | "
                  + stall_shares(t, stalls, 7))
        return
    for samples, n, text, top in sorted(lines, reverse=True)[:args.top]:
        print(f"{samples:6.0f} {n:8.2f}  {text[:70]:70s} " + " ".join(f"{s[6:]}:{v:.0f}" for v, s in top if v))


def stall_shares(t, stalls, n, skip_zero=False):
    """The `n` largest stall reasons of totals `t` (with t["samples"]), as shares: "wait 25%, ..."."""
    top = sorted(((t[s], s) for s in stalls), reverse=True)[:n]
    return ", ".join(f"{s[6:]} {v / max(t['samples'], 1) * 100:.0f}%" for v, s in top if v or not skip_zero)


def print_opcode(rows, col, stalls, opcode):
    """Per region: the lines whose opcode starts with `opcode`, their share of the region's stall
    samples and their own top stall reasons."""
    regions = {}
    for region, r in by_region(rows, sass=source):
        g = regions.setdefault(region, {"all": 0.0, "lines": 0, "samples": 0.0, **{s: 0.0 for s in stalls}})
        samples = number(r[col["Warp Stall Sampling (All Samples)"]])
        g["all"] += samples
        if opcode_of(r[1]).startswith(opcode):
            g["lines"] += 1
            g["samples"] += samples
            for s in stalls:
                g[s] += number(r[col[s]])
    for k, g in regions.items():
        if not g["lines"]:
            continue
        print(f"region {k}: {g['lines']} {opcode} lines, samples {g['samples']:.0f} "
              f"({g['samples'] / max(g['all'], 1) * 100:.0f}% of the region's) | " + stall_shares(g, stalls, 5, skip_zero=True))


def print_counts(rows, col, per):
    """Each region's lines grouped by count a block per warp (2 decimals; 1 and over together)."""
    groups = {}
    for region, r in by_region(rows, sass=source):
        n = number(r[col["Instructions Executed"]]) / per
        key = (region, 1.0 if n >= 1 else round(n, 2))
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += n
        g[2] += number(r[col["Warp Stall Sampling (All Samples)"]])
    for (k, count), (lines, instr, samples) in sorted(groups.items()):
        if samples >= 20:
            label = ">=1" if count == 1.0 else f"{count:.2f}"
            print(f"region {k}: count {label:>5}  lines {lines:5d}  instructions {instr:8.1f}  samples {samples:6.0f}")


if __name__ == "__main__":
    main()

"""A role's steady loop, compared between two builds (SASS, offline).

The largest loop of a region (the span from a backward branch's target to the branch) is the
role's per-block loop in the decode kernels. Its length is what a patch adds to every block
(static: a rarely taken branch inside counts too), and the opcode histogram against another
build's shows what kind of work moved: session 41 found the claims patch moving the pair
producer's cursor off the uniform datapath (U* opcodes) into vector registers.

    cuobjdump -sass -fun <mangled decode_kernel name> X.cubin > k.sass
    python3 benchmarks/sass_loops.py base.sass patched.sass --region 3   # 3: the pair producer

For WG0's region (2) it also counts the path every full block runs from QK's wait to P's store
(instructions and their control bits' stall cycles): session 47 found a copy issue behind a
rarely taken branch making that path 13 instructions and ~50 stall cycles longer.
"""
import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sass_text import opcode_of, parse, regions  # noqa: E402

_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def largest_loop(instrs):
    """The instructions of the longest backward-branch span of a region, in address order
    (empty when the region has no loop)."""
    best = []
    for ins in instrs:
        m = _BRANCH_TARGET.search(ins.op)
        if m and int(m.group(1), 16) < ins.addr:
            body = [x for x in instrs if int(m.group(1), 16) <= x.addr <= ins.addr]
            if len(body) > len(best):
                best = body
    return best


def qk_to_p_path(loop):
    """WG0's path in its block loop from the QK product's wait (the first WARPGROUP.DEPBAR after
    the last m64n64 HGMMA) to P's first STS.128, without what forward branches inside it jump
    over (the copy issue of a piece's end, the masking of a block with invalid entries): the
    instructions every full block runs there (empty when the loop has no such span)."""
    qk = [i for i, x in enumerate(loop) if "HGMMA.64x64x16" in x.op]
    if not qk:
        return []
    start = next((i for i in range(qk[-1], len(loop)) if "WARPGROUP.DEPBAR" in loop[i].op), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(loop)) if opcode_of(loop[i].op) == "STS.128"), None)
    if end is None:
        return []
    path, skip_to = [], None
    for x in loop[start:end]:
        if skip_to is not None and x.addr < skip_to:
            continue
        skip_to = None
        path.append(x)
        m = _BRANCH_TARGET.search(x.op)
        if m and opcode_of(x.op) == "BRA" and loop[start].addr < int(m.group(1), 16) <= loop[end].addr:
            skip_to = int(m.group(1), 16)
    return path


def stall_cycles(instrs):
    """The stall counts of the instructions' control bits, added up (a static floor of the
    cycles a warp spends issuing them)."""
    return sum(x.control.stall for x in instrs if x.control is not None)


def opcode_changes(base, patched):
    """(opcode, count in base, count in patched) where they differ, largest change last."""
    a = collections.Counter(opcode_of(x.op) for x in base)
    b = collections.Counter(opcode_of(x.op) for x in patched)
    return sorted(((k, a[k], b[k]) for k in set(a) | set(b) if a[k] != b[k]),
                  key=lambda row: (abs(row[2] - row[1]), row[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("patched")
    ap.add_argument("--region", type=int, default=3, help="1-based, as sass_waits.py (default 3: the producer)")
    args = ap.parse_args()
    loops = []
    for path in (args.base, args.patched):
        found = regions(parse(Path(path).read_text()), sass=lambda ins: ins.op)
        if not 1 <= args.region <= len(found):
            sys.exit(f"{path}: region {args.region} not found (it has {len(found)})")
        loops.append(largest_loop(found[args.region - 1]))
    print(f"largest loop of region {args.region}: {len(loops[0])} -> {len(loops[1])} instructions")
    paths = [qk_to_p_path(loop) for loop in loops]
    if all(paths):  # WG0's region
        print(f"  QK's wait -> P's store, every full block: {len(paths[0])} -> {len(paths[1])} instructions, "
              f"{stall_cycles(paths[0])} -> {stall_cycles(paths[1])} stall cycles")
    for op, a, b in opcode_changes(*loops):
        print(f"  {op:28s} {a:5d} {b:5d} {b - a:+d}")


if __name__ == "__main__":
    main()

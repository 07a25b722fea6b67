"""How soon a role's shared-memory stores have their source registers overwritten (SASS).

A store (STS, or STAS: st.async to the peer CTA) waits in the shared-memory queue and reads
its address and data registers only when it leaves it. An instruction that writes one of
those registers first has to wait for that (ncu: `short_scoreboard`): session 37 found this
the pair producer's largest stall. This counts, for every store of one SASS region, how many
instructions later a register it reads is next written; a variant that leaves more distance
should wait less. Offline, on a local build (docs/performance.md, "Registers, spills and
SASS without a GPU"):

    cuobjdump -sass -fun <mangled decode_kernel name> X.cubin > k.sass
    python3 benchmarks/store_reuse.py k.sass --region 3    # region 3: the pair producer

Regions as in sass_text.by_region (region k is the code after the k-th USETMAXREG), each cut at its
first EXIT: what follows is other roles' out-of-line code. The count follows the code in address order, not its branches: a store
near a loop's end whose registers the loop's top rewrites counts as never overwritten.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sass_text import base_opcode, instructions, reads, regions, writes  # noqa: E402


def store_reads(op):
    """Registers a store reads (address and data), or None if `op` is not a shared store."""
    return reads(op) if base_opcode(op) in ("STS", "STAS") else None


def distances(ops):
    """For each store, instructions until one of its registers is next written (None: never)."""
    out = []
    for i, op in enumerate(ops):
        sources = store_reads(op)
        if sources is None:
            continue
        out.append(next((j - i for j in range(i + 1, len(ops)) if writes(ops[j]) & sources), None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass", help="cuobjdump -sass output of one kernel")
    ap.add_argument("--region", type=int, required=True, help="1 = the code after the first USETMAXREG")
    ap.add_argument("--near", type=int, default=8, help="report stores overwritten within this many instructions")
    args = ap.parse_args()
    ops = regions(instructions(open(args.sass).read()))[args.region - 1]
    ds = distances(ops)
    seen = sorted(d for d in ds if d is not None)
    print(f"region {args.region}: {len(ops)} instructions, {len(ds)} shared stores, "
          f"{len(ds) - len(seen)} never overwritten in the region")
    if seen:
        near = sum(d <= args.near for d in seen)
        print(f"  instructions to the first overwrite: min {seen[0]}, median {seen[len(seen) // 2]}, "
              f"within {args.near}: {near}")


if __name__ == "__main__":
    main()

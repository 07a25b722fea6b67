"""Where a role waits on a scoreboard for work it does not need (SASS control bits, offline).

Volta and later have six scoreboards a warp. A variable-latency instruction (a load, a
shared-memory store) counts itself on one when it issues, and an instruction that needs its
result (or needs it to have read its sources) waits until that scoreboard is clear: until
every instruction counted on it is done, not only the one it needs. So a compare on an index
loaded long ago can wait for a batch of loads issued just before it, if ptxas put them on
the same scoreboard. Session 38's `pair_pingpong` lost 7% that way: the pair producer's
`ISETP` on block n + 3's index waited on the scoreboard of the 11 row loads issued one
instruction earlier, a whole load's latency every second block (ncu: 27% of its samples).

For each instruction of a region that waits on a scoreboard, this walks the region in
address order (not its branches) and reports the waits whose youngest pending instruction on
that scoreboard is a global load's result, issued within --near instructions, that the
waiting instruction does not touch, while what it does use was issued at least --gap
instructions earlier: a wait for a fresh load it does not need.

    cuobjdump -sass -fun <mangled decode_kernel name> X.cubin > k.sass
    python3 benchmarks/sass_waits.py k.sass --region 3    # region 3: the pair producer
"""
import argparse
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sass_text import NO_SCOREBOARD, base_opcode, parse, reads, regions, writes  # noqa: E402


class Wait(NamedTuple):
    index: int  # of the waiting instruction in the region
    addr: int
    op: str
    scoreboard: int
    pending: int  # instructions counted on the scoreboard since its last wait
    distance: int  # instructions back to the youngest of them
    youngest: str
    on_result: bool  # the youngest counts until its result is written (not until its sources are read)
    needed: bool  # the waiting instruction touches a register the youngest one writes or reads
    needed_distance: Optional[int]  # back to the youngest pending one it does touch (None: none)


def waits(instrs):
    """Every wait on a scoreboard with instructions pending on it, in order."""
    pending = {k: [] for k in range(6)}  # scoreboard -> [(index, instruction, counted by its write?)]
    out = []
    for i, ins in enumerate(instrs):
        ctl = ins.control
        if ctl is None:
            continue
        for k in range(6):
            if not (ctl.wait_mask >> k) & 1 or not pending[k]:
                continue
            touched = reads(ins.op) | writes(ins.op)

            def uses(entry):  # the waiting instruction needs this pending one done
                _, other, by_result = entry
                return bool(writes(other.op) & touched) if by_result else bool(reads(other.op) & writes(ins.op))

            j, young, by_write = pending[k][-1]
            used = [i - e[0] for e in reversed(pending[k]) if uses(e)]
            out.append(Wait(i, ins.addr, ins.op, k, len(pending[k]), i - j, young.op, by_write,
                            uses(pending[k][-1]), used[0] if used else None))
            pending[k] = []
        depbar = re.match(r"DEPBAR\.LE SB(\d), (0x[0-9a-f]+|\d+)", ins.op)
        if depbar:  # waits until at most n are pending: the n youngest stay
            k, n = int(depbar.group(1)), int(depbar.group(2), 0)
            pending[k] = pending[k][len(pending[k]) - n:] if n else []
        if ctl.write_sb != NO_SCOREBOARD:
            pending[ctl.write_sb].append((i, ins, True))
        if ctl.read_sb != NO_SCOREBOARD:
            pending[ctl.read_sb].append((i, ins, False))
    return out


def needless_load_waits(found, near, gap):
    """The waits whose youngest pending instruction is a global load's result, within `near`,
    that the waiting instruction does not use, while what it does use was issued at least `gap`
    instructions before that load (or it uses none): the wait costs a fresh load's latency that
    it would not have had. (A wait for a load to have read its address registers is short:
    left out.)"""
    return [w for w in found
            if w.on_result and not w.needed and w.distance <= near and base_opcode(w.youngest) in ("LDG", "LDGSTS") and
            (w.needed_distance is None or w.needed_distance - w.distance >= gap)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass", help="cuobjdump -sass output of one kernel")
    ap.add_argument("--region", type=int, required=True, help="1 = the code after the first USETMAXREG")
    ap.add_argument("--near", type=int, default=24, help="report loads issued this many instructions before or fewer")
    ap.add_argument("--gap", type=int, default=64,
                    help="... when what the instruction uses was issued at least this many before them")
    args = ap.parse_args()
    instrs = regions(parse(open(args.sass).read()), sass=lambda ins: ins.op)[args.region - 1]
    found = waits(instrs)
    bad = needless_load_waits(found, args.near, args.gap)
    print(f"region {args.region}: {len(instrs)} instructions, {len(found)} scoreboard waits, "
          f"{len(bad)} on global loads issued within {args.near} instructions that it does not need")
    for w in bad:
        used = "none of them" if w.needed_distance is None else f"one {w.needed_distance} back"
        print(f"  {w.addr:#07x} {w.op}  waits SB{w.scoreboard} for {w.pending}, the youngest "
              f"{w.distance} back: {w.youngest}; it uses {used}")


if __name__ == "__main__":
    main()

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

Regions as in ncu_roles.py (region k is the code after the k-th USETMAXREG), each cut at its
first EXIT: what follows is other roles' out-of-line code. The count follows the code in address order, not its branches: a store
near a loop's end whose registers the loop's top rewrites counts as never overwritten.
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ncu_roles import by_region  # noqa: E402

_ADDR = re.compile(r"(?:/\*[0-9a-f]+\*/)?\s*(.*?)\s*;")
_STORE = re.compile(r"(?:@!?U?P\w+\s+)?(STS|STAS)(\.(\d+))?\s+\[([^\]]*)\],\s*(R\d+|RZ)")
_DEST = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+(R\d+)\b")
# Opcodes whose first register operand is read, not written.
_NO_DEST = ("ST", "RED", "ATOM", "BRA", "BAR", "SYNCS", "MEMBAR", "FENCE", "WARPSYNC", "NOP", "EXIT",
            "BSYNC", "BSSY", "CCTL", "HGMMA", "WARPGROUP", "UTMA", "UBLKPF", "CALL", "RET", "YIELD")


def instructions(text):
    """The SASS instructions of cuobjdump's output, in order (encodings and blank lines dropped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("/*") or line.startswith("/* 0x"):
            continue
        m = _ADDR.match(line)
        if m and m.group(1):
            out.append(m.group(1))
    return out


def regions(instrs):
    """Lists of instructions: region k (ncu_roles.by_region) without its USETMAXREG and from
    its first EXIT on."""
    found, ended = {}, set()
    for k, op in by_region(instrs, sass=lambda op: op):
        if k == 0 or k in ended:
            continue
        ops = found.setdefault(k, [])
        if re.search(r"\bEXIT\b", op):
            ended.add(k)
        elif "USETMAXREG" not in op:
            ops.append(op)
    return [found[k] for k in sorted(found)]


def _regs(first, count):
    return {first + i for i in range(count)}


def store_reads(op):
    """Registers a store reads (address and data), or None if `op` is not a shared store."""
    m = _STORE.match(op)
    if not m:
        return None
    addr = set()
    for r, wide in re.findall(r"\bR(\d+)(\.64)?", m.group(4)):
        addr |= _regs(int(r), 2 if wide else 1)
    width = int(m.group(3) or 32) // 32
    data = set() if m.group(5) == "RZ" else _regs(int(m.group(5)[1:]), width)
    return addr | data


def writes(op):
    """Registers an instruction writes (its first register operand, with its width for loads)."""
    m = _DEST.match(op)
    if not m or m.group(1).startswith(_NO_DEST):
        return set()
    opcode, first = m.group(1), int(m.group(2)[1:])
    width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
    return _regs(first, width)


def distances(ops):
    """For each store, instructions until one of its registers is next written (None: never)."""
    out = []
    for i, op in enumerate(ops):
        reads = store_reads(op)
        if reads is None:
            continue
        out.append(next((j - i for j in range(i + 1, len(ops)) if writes(ops[j]) & reads), None))
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

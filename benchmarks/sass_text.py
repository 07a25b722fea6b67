"""cuobjdump's SASS text, read: instructions with their control bits, the roles' regions, and
the registers an instruction reads and writes. Shared by the offline SASS tools
(store_reuse.py, sass_waits.py).

Each instruction of `cuobjdump -sass` is two lines, the second holding the upper 64 bits of
its encoding. From bit 41 of that word on (bits 105.. of the instruction) Volta and later
keep the scheduling controls that ptxas writes: stall cycles (4 bits), yield (1), the
scoreboard the instruction's result sets (3: 7 = none), the one its source reads set (3),
the mask of scoreboards it waits for before issuing (6), and operand reuse flags (4).
"""
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ncu_roles import by_region  # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s*(.*?)\s*;\s*(?:/\*\s*(0x[0-9a-f]+)\s*\*/)?")
_WORD = re.compile(r"^/\*\s*(0x[0-9a-f]+)\s*\*/$")
_DEST = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+(R\d+)\b")
# Opcodes whose first register operand is read, not written.
_NO_DEST = ("ST", "RED", "ATOM", "BRA", "BAR", "SYNCS", "MEMBAR", "FENCE", "WARPSYNC", "NOP", "EXIT",
            "BSYNC", "BSSY", "CCTL", "HGMMA", "WARPGROUP", "UTMA", "UBLKPF", "CALL", "RET", "YIELD")
NO_SCOREBOARD = 7


class Control(NamedTuple):
    stall: int
    yield_: int
    write_sb: int  # set when the result is written (NO_SCOREBOARD: none)
    read_sb: int  # set when the sources have been read
    wait_mask: int  # scoreboards (bit k: SB k) that must be clear before issue


class Instr(NamedTuple):
    addr: int
    op: str
    control: Optional[Control]  # None where the text had no second word


def control_of(upper_word):
    c = upper_word >> 41
    return Control(c & 0xF, (c >> 4) & 1, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F)


def parse(text):
    """The instructions of cuobjdump's output, in address order."""
    out = []
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        if not m or not m.group(2):
            continue
        nxt = _WORD.match(lines[i + 1]) if i + 1 < len(lines) else None
        out.append(Instr(int(m.group(1), 16), m.group(2), control_of(int(nxt.group(1), 16)) if nxt else None))
    return out


def instructions(text):
    """The instructions' texts, in order (encodings and blank lines dropped)."""
    return [ins.op for ins in parse(text)]


def regions(items, sass=lambda item: item):
    """Lists of items: region k (ncu_roles.by_region) without its USETMAXREG and from its first
    EXIT on (what follows is other roles' out-of-line code). `sass`: an item's text."""
    found, ended = {}, set()
    for k, item in by_region(items, sass=sass):
        if k == 0 or k in ended:
            continue
        kept = found.setdefault(k, [])
        if re.search(r"\bEXIT\b", sass(item)):
            ended.add(k)
        elif "USETMAXREG" not in sass(item):
            kept.append(item)
    return [found[k] for k in sorted(found)]


def register_span(first, count):
    return {first + i for i in range(count)}


def writes(op):
    """Registers an instruction writes (its first register operand, with its width for loads)."""
    m = _DEST.match(op)
    if not m or m.group(1).startswith(_NO_DEST):
        return set()
    opcode, first = m.group(1), int(m.group(2)[1:])
    width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
    return register_span(first, width)


def reads(op):
    """Registers an instruction reads: every register operand but the one it writes (64-bit
    addresses as two, a store's data with its width)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", op)
    opcode, _, body = body.partition(" ")
    written = writes(op)
    if written:
        body = body.split(",", 1)[1] if "," in body else ""
    out = set()
    for r, wide in re.findall(r"\bR(\d+)(\.64)?", body):
        out |= register_span(int(r), 2 if wide else 1)
    width = re.search(r"\.(64|128)\b", opcode)
    data = re.search(r"\bR(\d+)\s*$", body)
    if opcode.startswith("ST") and width and data:  # a store's data, its last operand
        out |= register_span(int(data.group(1)), int(width.group(1)) // 32)
    return out

"""SASS text, read: instructions with their control bits, the roles' regions, opcodes, and the
registers an instruction reads and writes. Shared by the SASS tools (ncu_roles.py on ncu's
source counters; store_reuse.py and sass_waits.py on cuobjdump's output).

Each instruction of `cuobjdump -sass` is two lines, the second holding the upper 64 bits of
its encoding. From bit 41 of that word on (bits 105.. of the instruction) Volta and later
keep the scheduling controls that ptxas writes: stall cycles (4 bits), yield (1), the
scoreboard the instruction's result sets (3: 7 = none), the one its source reads set (3),
the mask of scoreboards it waits for before issuing (6), and operand reuse flags (4).
"""
import re
from typing import NamedTuple, Optional

_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s*(.*?)\s*;\s*(?:/\*\s*(0x[0-9a-f]+)\s*\*/)?")
_WORD = re.compile(r"^/\*\s*(0x[0-9a-f]+)\s*\*/$")
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


def by_region(rows, sass=lambda row: row):
    """(region, row) for each SASS row: region k is the code after the k-th USETMAXREG (the
    roles of a warp-specialized kernel start at their `setmaxnreg`). `sass`: a row's text."""
    region = 0
    for r in rows:
        if "USETMAXREG" in sass(r):
            region += 1
        yield region, r


def split_instruction(op):
    """(opcode, operands) of a SASS line, its predicate (`@P0`, `@!UP1`) skipped."""
    words = op.split(None, 1)
    if words and words[0].startswith("@"):
        words = words[1].split(None, 1) if len(words) > 1 else []
    return (words[0], words[1] if len(words) > 1 else "") if words else ("", "")


def opcode_of(op):
    """`@!P0 MUFU.EX2 R1, R2` -> `MUFU.EX2`."""
    return split_instruction(op)[0]


def base_opcode(op):
    """`@!P0 LDG.E.128 R4, [R2.64]` -> `LDG` (the opcode without its modifiers)."""
    return opcode_of(op).split(".")[0]


def regions(items, sass=lambda item: item):
    """Lists of items: region k (by_region) without its USETMAXREG and from its first
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
    opcode, operands = split_instruction(op)
    m = re.match(r"R(\d+)\b", operands)
    if not m or opcode.startswith(_NO_DEST):
        return set()
    width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
    return register_span(int(m.group(1)), width)


def reads(op):
    """Registers an instruction reads: every register operand but the one it writes (64-bit
    addresses as two, a store's data with its width)."""
    opcode, body = split_instruction(op)
    if writes(op):
        body = body.split(",", 1)[1] if "," in body else ""
    out = set()
    for r, wide in re.findall(r"\bR(\d+)(\.64)?", body):
        out |= register_span(int(r), 2 if wide else 1)
    width = re.search(r"\.(64|128)\b", opcode)
    data = re.search(r"\bR(\d+)\s*$", body)
    if opcode.startswith("ST") and width and data:  # a store's data, its last operand
        out |= register_span(int(data.group(1)), int(width.group(1)) // 32)
    return out

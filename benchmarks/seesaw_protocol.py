"""The hand-offs of benchmarks/patches/seesaw.patch (alternating consumers), as a model run
under random interleavings: one CTA, each warpgroup one actor (their warps act alike), the
producer filling the two tile buffers. Checks that nothing deadlocks and that every read sees
the block it expects: a tile, P and the hand-off record of the right block, Q of the right
piece, final_s of the right piece, each consumer's O holding exactly its piece's blocks in
order, and every phase of a named barrier completed by one arrival of each warpgroup for the
same block. The model follows `consume`'s control flow by hand: change both together.

    python3 benchmarks/seesaw_protocol.py 3000    # random walks; prints the failures

`one_barrier=True` hands every block's P over one barrier ID, the flaw the design avoids
(an owner's arrival meeting its own sync of the next phase): the model must catch it.
`split_release=True` models seesaw_split_release.patch: each warpgroup releases a buffer on
its own `empty` barrier, and the producer refills the value columns of the block's owner
first, then the rest once the other released too (V32's P, kept in the RoPE columns, is
overwritten then). `mistake` makes the producer wait for the two releases the other way round
("swapped_waits": the owner's columns stored behind the other's release) or store the RoPE
columns in the first part ("rope_first"): the model must catch both.
"""
import random
import sys


class _Named:  # a named barrier of two participants (the warpgroups' 128 threads each)
    def __init__(self):
        self.count, self.phase, self.log = 0, 0, []


class _MBar:  # an mbarrier: `phase` completed phases
    def __init__(self, need):
        self.need, self.count, self.phase = need, 0, 0


def run(pieces, seed, one_barrier=False, split_release=False, mistake=None):
    """The errors (strings) of one walk over pieces of the given lengths under the interleaving
    `seed` picks; [] when it ran through."""
    rnd = random.Random(seed)
    steps = [dict(piece=p, last=j == length - 1, walk_ends=False) for p, length in enumerate(pieces)
             for j in range(length)]
    steps[-1]["walk_ends"] = True
    full, qfull = [_MBar(1), _MBar(1)], _MBar(1)
    # empty[buf][wg]: with split_release one barrier a warpgroup (one arrival), else one a buffer
    empty = ([[_MBar(1), _MBar(1)] for _ in range(2)] if split_release
             else [[_MBar(2)] * 2 for _ in range(2)])
    bars = {i: _Named() for i in (1, 2, 3)}
    # A tile's parts: the value columns of warpgroup 0 and 1, the rest (RoPE columns, valid words)
    tile, pbuf, rec, final, q = [[None] * 3, [None] * 3], [None, None], [None, None], [None, None], [None]
    err = []

    def check(ok, msg):
        if not ok:
            err.append(msg)

    def p_ready(buf):
        return 1 if one_barrier else 1 + buf

    def mb_arrive(b):
        b.count += 1
        if b.count == b.need:
            b.count, b.phase = 0, b.phase + 1

    def mb_wait(b, parity):  # try_wait.parity: the phase of that parity has completed
        while not (b.phase > 0 and (b.phase - 1) % 2 == parity):
            yield

    def bar_count(i, kind, who, tag):
        b = bars[i]
        b.count += 1
        b.log.append((kind, who, tag))
        if b.count == 2:
            a, c = b.log[-2], b.log[-1]
            check(a[1] != c[1], f"barrier {i}: one warpgroup completed a phase alone: {a} {c}")
            check(a[2][1] == c[2][1], f"barrier {i}: a phase pairs {a} with {c}")
            b.count, b.phase = 0, b.phase + 1

    def bar_sync(i, who, tag):
        mine = bars[i].phase
        bar_count(i, "sync", who, tag)
        while bars[i].phase == mine:
            yield

    def producer():
        for n in range(len(steps)):
            b, parity = n & 1, ((n >> 1) & 1) ^ 1
            if split_release:
                first = n & 1  # the owner of block n - 2, which releases its columns first
                waits = (1 - first, first) if mistake == "swapped_waits" else (first, 1 - first)
                if n >= 2:  # (the first two buffers start free)
                    yield from mb_wait(empty[b][waits[0]], parity)
                tile[b][first] = n
                if mistake == "rope_first":
                    tile[b][2], pbuf[b] = n, None
                yield
                if n >= 2:
                    yield from mb_wait(empty[b][waits[1]], parity)
                tile[b][1 - first] = tile[b][2] = n
                pbuf[b] = None  # (V32: P is in the RoPE columns)
            else:
                if n >= 2:
                    yield from mb_wait(empty[b][0], parity)
                tile[b] = [n] * 3
            mb_arrive(full[b])
            yield

    def holds(buf, n, *parts):
        return all(tile[buf][k] == n for k in parts)

    def load_q(piece):
        q[0] = piece
        mb_arrive(qfull)

    def consumer(wg):
        if wg == 0:
            load_q(0)
        first, piece, q_piece, prev, chain, o, n = True, 0, -1, None, None, [], 0
        while True:
            st, buf = steps[n], n & 1
            own = (n & 1) == wg
            if not own:
                if not st["last"]:  # its P V goes behind this warpgroup's next QK
                    prev, first, n = n, False, n + 1
                    yield
                    continue
                yield from mb_wait(full[buf], (n >> 1) & 1)
                yield from bar_sync(p_ready(buf), wg, ("other", n))
                check(rec[buf] == n and pbuf[buf] == n and holds(buf, n, wg),
                      f"wg{wg}: the other's block {n} reads record {rec[buf]}, P {pbuf[buf]}, tile {tile[buf]}")
                o.append(n)
                yield  # (the P V runs)
                check(holds(buf, n, wg) and pbuf[buf] == n, f"wg{wg}: block {n} overwritten under its P V")
                mb_arrive(empty[buf][wg])
            else:
                help_ = n > 0 and not first
                if q_piece != piece:
                    yield from mb_wait(qfull, piece & 1)
                    q_piece = piece
                yield from mb_wait(full[buf], (n >> 1) & 1)
                if help_:
                    yield from mb_wait(full[prev & 1], ((n - 1) >> 1) & 1)
                check(holds(buf, n, 0, 1, 2) and q[0] == st["piece"],
                      f"wg{wg}: QK({n}) reads tile {tile[buf]} and Q of piece {q[0]}")
                if help_:
                    pb = prev & 1
                    yield from bar_sync(p_ready(pb), wg, ("help", prev))
                    check(prev == n - 1 and rec[pb] == prev and pbuf[pb] == prev and holds(pb, prev, wg),
                          f"wg{wg}: helping block {prev} reads record {rec[pb]}, P {pbuf[pb]}, tile {tile[pb]}")
                    chain = prev
                    o.append(prev)
                    yield  # (QK and the other's P V run)
                    check(holds(pb, prev, wg) and pbuf[pb] == prev and holds(buf, n, 0, 1, 2),
                          f"wg{wg}: block {prev} or {n} overwritten under its products")
                    mb_arrive(empty[pb][wg])
                else:
                    chain = None
                yield
                if st["last"] and not st["walk_ends"]:
                    load_q(st["piece"] + 1)
                check(first or chain == n - 1, f"wg{wg}: softmax({n}) continues the state after block {chain}")
                pbuf[buf] = rec[buf] = n
                bar_count(p_ready(buf), "arrive", wg, ("own", n))
                o.append(n)
                yield  # (its own P V runs)
                check(holds(buf, n, wg), f"wg{wg}: block {n} overwritten under its own P V")
                mb_arrive(empty[buf][wg])
            first = st["last"]
            if st["last"]:
                if own:
                    final[piece & 1] = st["piece"]
                yield from bar_sync(3, wg, ("end", st["piece"]))
                check(final[piece & 1] == st["piece"], f"wg{wg}: final_s {final[piece & 1]} for piece {st['piece']}")
                blocks = [k for k, s in enumerate(steps) if s["piece"] == st["piece"]]
                check(o == blocks, f"wg{wg}: piece {st['piece']}'s O holds blocks {o}, wants {blocks}")
                o, piece = [], piece + 1
            if st["walk_ends"]:
                return
            n += 1
            yield

    actors = {"producer": producer(), 0: consumer(0), 1: consumer(1)}
    for _ in range(200000):
        if not actors or err:
            return err
        who = rnd.choice(list(actors))
        try:
            next(actors[who])
        except StopIteration:
            del actors[who]
    return [f"no progress: {sorted(map(str, actors))} still waiting"]


def random_walks(count, one_barrier=False, split_release=False, mistake=None):
    """(seed, pieces, errors) of each failing walk of `count` random ones."""
    failures = []
    for seed in range(count):
        r = random.Random(seed)
        pieces = [r.choice([1, 1, 2, 3, 4, 5, 8]) for _ in range(r.randint(1, 6))]
        errors = run(pieces, seed, one_barrier, split_release, mistake)
        if errors:
            failures.append((seed, pieces, errors))
    return failures


if __name__ == "__main__":
    found = random_walks(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, split_release="--split" in sys.argv)
    for seed, pieces, errors in found[:5]:
        print(seed, pieces, errors[:3])
    print(f"{len(found)} failing walks")

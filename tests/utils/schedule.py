"""Block counts of the split-KV schedule (docs/schedule.md), in NumPy: a request of main length L
and extra length EL (each clamped to its list size) has max(ceil(L / 64), 1) + ceil(EL / 64)
blocks."""

import numpy as np

BLOCK_ENTRIES = 64


def request_blocks(lens, topk, extra_lens=None, extra_topk=0):
    """Blocks per request, as an int array shaped like `lens`."""
    main = np.clip(np.asarray(lens), 0, topk)
    blocks = np.maximum(-(-main // BLOCK_ENTRIES), 1)
    if extra_lens is not None and extra_topk:
        blocks = blocks + -(-np.clip(np.asarray(extra_lens), 0, extra_topk) // BLOCK_ENTRIES)
    return blocks.astype(int)

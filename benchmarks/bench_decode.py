"""Benchmark of jax_sparse_mla's decode: a thin wrapper around `jax_sparse_mla.bench.main`.

    python benchmarks/bench_decode.py --shapes all --iters 20 --plot benchmarks/bench.png

Its table leads with device µs per call (the profiler's span of the calls), wall µs beside; the
module docstring of `jax_sparse_mla.bench` says how each is taken and which the ratios use.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_sparse_mla.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

"""Command line: `python -m jax_sparse_mla demo|bench|info [...]` (`--help` for each)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m jax_sparse_mla COMMAND [ARGS]

commands:
  demo    decode with a small random-weight DeepSeek-style model (speed, agreement with dense)
  layer   load a DeepSeek-V3.2 attention layer (synthetic checkpoint by default) and decode with it
  bench   time the op against the reference (see `bench --help`)
  info    how the extension was built
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from jax_sparse_mla import demo

        return demo.main(rest)
    if command == "layer":
        from jax_sparse_mla import layer_demo

        return layer_demo.main(rest)
    if command == "bench":
        from jax_sparse_mla import bench  # written with the CUDA kernels

        return bench.main(rest) or 0
    if command == "info":
        import jax_sparse_mla

        for key, value in jax_sparse_mla.build_info().items():
            print(f"{key}: {value}")
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m jax_sparse_mla demo|layer|bench|info [...]` (`--help` for each)."""

from __future__ import annotations

import re
import sys

USAGE = """usage: python -m jax_sparse_mla COMMAND [ARGS]

commands:
  demo    decode with a small random-weight DeepSeek-style model (speed, agreement with dense)
  layer   load a DeepSeek-V3.2 attention layer (synthetic checkpoint by default) and decode with it
  bench   time the op against the reference (see `bench --help`)
  info    how the extension was built and whether JAX sees a GPU to run its CUDA handlers
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from jax_sparse_mla.apps import demo

        return demo.main(rest)
    if command == "layer":
        from jax_sparse_mla.apps import layer_demo

        return layer_demo.main(rest)
    if command == "bench":
        from jax_sparse_mla.apps import bench  # written with the CUDA kernels

        return bench.main(rest) or 0
    if command == "info":
        print("\n".join(info_lines()))
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def info_lines() -> list[str]:
    """What `info` prints: the build (CUDA handlers and their archs) apart from what JAX sees
    at run time (a GPU), and so where a decode runs."""
    import jax

    import jax_sparse_mla

    build = jax_sparse_mla.build_info()
    archs = build["cuda_archs"]  # e.g. ["sm_90a"]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend at all
        gpus = []
    # "9.0" -> "90"; an sm_90a kernel runs only on compute capability 9.0 exactly.
    ccs = [re.sub(r"\D", "", str(getattr(d, "compute_capability", ""))) for d in gpus]
    lines = [
        f"jax_sparse_mla {build['version']}, built against jaxlib {build['jaxlib']}",
        "CUDA handlers built: " + (f"yes, for {', '.join(archs)}" if build["cuda"] else "no"),
        f"JAX {jax.__version__}, default backend: {jax.default_backend()}",
        "GPUs JAX sees: " + (", ".join(f"{d} ({d.device_kind}, sm_{cc})" for d, cc in zip(gpus, ccs))
                             if gpus else "none"),
    ]
    covered = [d for d, cc in zip(gpus, ccs) if any(re.sub(r"\D", "", a) == cc for a in archs)]
    if not gpus:
        where = "the CPU handlers" + (" (the CUDA handlers were built but JAX sees no GPU)" if build["cuda"] else "")
    elif not build["cuda"]:
        where = "the CPU handlers only: this build has no CUDA handlers, so a decode on the GPU fails"
    elif len(covered) < len(gpus):
        where = f"the CUDA handlers on {len(covered)} of {len(gpus)} GPUs (the others are not {', '.join(archs)})"
    else:
        where = "the CUDA handlers on the GPU(s), the CPU handlers for CPU arrays"
    return lines + [f"decode runs on: {where}"]

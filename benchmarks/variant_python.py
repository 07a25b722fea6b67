"""Runs a script or `-c` code against one kernel variant's build (device_run.sh, VARIANT_PREBUILD=1):

    python3 benchmarks/variant_python.py SITE SCRIPT [ARGS...]
    python3 benchmarks/variant_python.py SITE -c CODE [ARGS...]

SITE holds the jax_sparse_mla that `pip install --target SITE` built from a patched copy of the
tree. It is imported first, ahead of the tree in the working directory and of an editable
install's import redirect (scikit-build-core's finder on sys.meta_path), so that scripts which
put the repository root first on sys.path (gpu_smoke.py) still get the variant.
"""

import os
import runpy
import sys


def main():
    if len(sys.argv) < 3 or (sys.argv[2] == "-c" and len(sys.argv) < 4):
        sys.exit(__doc__)
    site = sys.argv[1]
    if not os.path.isdir(os.path.join(site, "jax_sparse_mla")):
        sys.exit(f"variant_python: no jax_sparse_mla in {site} (did the variant's build fail?)")
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, site)
    import jax_sparse_mla

    if not jax_sparse_mla.__file__.startswith(site):
        sys.exit(f"variant_python: jax_sparse_mla came from {jax_sparse_mla.__file__}, not {site}")
    if sys.argv[2] == "-c":
        code, sys.argv = sys.argv[3], ["-c", *sys.argv[4:]]
        sys.path.insert(1, "")  # as `python -c`: the working directory, after the variant
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    else:
        script, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

"""`python -m jax_sparse_mla COMMAND`: the command line of `apps/cli.py`."""

import sys

from jax_sparse_mla.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())

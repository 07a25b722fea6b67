"""The command-line applications, apart from the library: `cli.py` (`python -m jax_sparse_mla`),
the demo and its model (`demo.py`, `model.py`), the layer demo (`layer_demo.py`), the benchmark
(`bench.py`) and its profiler summary (`trace_summary.py`)."""

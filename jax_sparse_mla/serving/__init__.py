"""Serving the op: multi-device layouts (`sharding.py`), the DeepSeek-V3.2 NNX attention layer
(`nnx.py`, with `yarn.py` and the FP8 `indexer.py`) and checkpoint loading (`checkpoint.py`)."""

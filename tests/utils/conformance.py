"""The FlashMLA conformance vectors (docs/numerics.md, Conformance vectors): finding and loading them."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tests.utils.np_formats import BF16
from tests.utils.paths import REPO_ROOT


def _find_conformance_dir():
    cand = REPO_ROOT / "tests" / "conformance_vectors"
    return cand if cand.is_dir() and any(cand.glob("*.npz")) else None


#: Directory of the FlashMLA conformance vectors, or None when it holds none.
CONFORMANCE_DIR = _find_conformance_dir()


def conformance_files():
    """Sorted list of the ``*.npz`` conformance vectors (empty when there are none)."""
    if CONFORMANCE_DIR is None:
        return []
    return sorted(CONFORMANCE_DIR.glob("*.npz"))


def _bf16_from_bytes(raw: np.ndarray, shape) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view("<u2").view(BF16).reshape(tuple(shape))


def load_conformance(path):
    """Load one vector. Returns a dict of jnp arrays:

    ``q`` bf16 ``[b, s_q, h_q, d_qk]``, ``kv`` uint8 ``kv_shape``, ``indices`` int32,
    ``sm_scale`` (python float), ``topk_length`` / ``attn_sink`` / ``extra_kv`` /
    ``extra_indices`` / ``extra_topk_length`` (None when absent), ``out`` bf16 ``out_shape``,
    ``lse`` float32 ``[b, h_q, s_q]``; also ``name`` (file stem) and, when stored, FlashMLA's
    ``sched_meta`` / ``num_splits`` / ``lse_ref``.
    """
    path = Path(path)
    with np.load(path) as z:
        d = {k: z[k] for k in z.files}
    v = {"name": path.stem}
    v["q"] = jnp.asarray(_bf16_from_bytes(d["q"], d["q_shape"]))
    v["kv"] = jnp.asarray(d["kv"].view(np.uint8).reshape(tuple(d["kv_shape"])))
    v["indices"] = jnp.asarray(d["indices"].astype(np.int32))
    v["sm_scale"] = float(d["sm_scale"])
    v["topk_length"] = jnp.asarray(d["topk_length"].astype(np.int32)) if "topk_length" in d else None
    v["attn_sink"] = jnp.asarray(d["attn_sink"].astype(np.float32)) if "attn_sink" in d else None
    if "extra_kv" in d:
        shape = tuple(d["extra_kv_shape"]) if "extra_kv_shape" in d else d["extra_kv"].shape
        v["extra_kv"] = jnp.asarray(d["extra_kv"].view(np.uint8).reshape(shape))
        v["extra_indices"] = jnp.asarray(d["extra_indices"].astype(np.int32))
    else:
        v["extra_kv"] = v["extra_indices"] = None
    v["extra_topk_length"] = (
        jnp.asarray(d["extra_topk_length"].astype(np.int32)) if "extra_topk_length" in d else None
    )
    v["out"] = jnp.asarray(_bf16_from_bytes(d["out"], d["out_shape"]))
    v["lse"] = jnp.asarray(d["lse"].astype(np.float32))
    for k in ("sched_meta", "num_splits", "lse_ref"):
        if k in d:
            v[k] = jnp.asarray(d[k])
    return v


def conformance_kwargs(v):
    """The keyword arguments of ``sparse_mla_decode`` for a loaded vector (absent ones left out)."""
    kw = {"q": v["q"], "kv_cache": v["kv"], "indices": v["indices"], "sm_scale": v["sm_scale"]}
    for src, dst in (
        ("topk_length", "topk_length"),
        ("attn_sink", "attn_sink"),
        ("extra_kv", "extra_kv_cache"),
        ("extra_indices", "extra_indices"),
        ("extra_topk_length", "extra_topk_length"),
    ):
        if v.get(src) is not None:
            kw[dst] = v[src]
    return kw

"""RoPE frequencies, with the YaRN context extension of DeepSeek's checkpoints.

DeepSeek V3/V3.2 ship `rope_scaling` in their `config.json`::

    {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

and apply it in three places, all reproduced here:

* frequencies: dimension pair ``i`` of a ``d``-dim RoPE rotates at ``theta ** (-2i / d)``
  unscaled; YaRN divides that by ``factor`` for the slow pairs, keeps it for the fast ones,
  and blends linearly between. The blend runs over pair indices ``[low, high]``, where ``low``
  (``high``) is the pair that turns ``beta_fast`` (``beta_slow``) times over
  ``original_max_position_embeddings`` positions, rounded down (up) and clipped to
  ``[0, d - 1]``;
* the softmax scale is multiplied by ``m(mscale_all_dim) ** 2``, with
  ``m(s) = 0.1 * s * ln(factor) + 1`` (1 when ``factor <= 1``);
* cos and sin are multiplied by ``m(mscale) / m(mscale_all_dim)`` (1 for every released
  DeepSeek config, where the two are equal).

DeepSeek's `inference/model.py` enables YaRN only when its `max_seq_len` exceeds
`original_max_position_embeddings`; here it is on whenever a config carries it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

__all__ = ["YarnScaling", "rope_frequencies", "yarn_mscale"]


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """A `rope_scaling` entry of type "yarn"; the fields carry DeepSeek's `config.json` names
    (defaults: those of DeepSeek's YaRN code when a key is absent)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor!r}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings!r}")
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError("rope_scaling: need beta_fast > beta_slow > 0, got "
                             f"beta_fast={self.beta_fast!r}, beta_slow={self.beta_slow!r}")

    @classmethod
    def from_config(cls, entry: "YarnScaling | Mapping[str, Any] | None") -> "YarnScaling | None":
        """From a `config.json` `rope_scaling` dict (its "type" or "rope_type" must be "yarn");
        a YarnScaling or None passes through."""
        if entry is None or isinstance(entry, cls):
            return entry
        if not isinstance(entry, Mapping):
            raise TypeError(f"rope_scaling must be a dict, a YarnScaling or None, got {type(entry).__name__}")
        kind = entry.get("type", entry.get("rope_type"))
        if kind != "yarn":
            raise ValueError(f"rope_scaling: only type 'yarn' is supported, got type {kind!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(entry) - names - {"type", "rope_type"})
        if unknown:
            raise ValueError(f"rope_scaling: unknown keys {unknown}; expected some of {sorted(names)}")
        return cls(**{k: v for k, v in entry.items() if k in names})

    @property
    def softmax_factor(self) -> float:
        """What the softmax scale is multiplied by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @property
    def rope_amplitude(self) -> float:
        """What cos and sin are multiplied by."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


def rope_frequencies(dim: int, theta: float, scaling: YarnScaling | None = None) -> np.ndarray:
    """Angular frequency of each of the `dim // 2` rotated pairs (float64), YaRN-scaled when
    `scaling` is given."""
    if dim < 2 or dim % 2:
        raise ValueError(f"rope dim must be even and >= 2, got {dim}")
    pair = np.arange(dim // 2, dtype=np.float64)
    freqs = theta ** (-2.0 * pair / dim)
    if scaling is None:
        return freqs

    def pair_turning(turns):
        # The (fractional) pair index whose wavelength fits `turns` times into the original context.
        return dim * math.log(scaling.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(pair_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(pair_turning(scaling.beta_slow)), dim - 1)
    if high == low:
        high += 0.001  # DeepSeek's guard against a zero-width blend
    interpolated = np.clip((pair - low) / (high - low), 0.0, 1.0)  # 0: keep, 1: divide by factor
    return freqs * (1.0 - interpolated) + freqs / scaling.factor * interpolated

"""One attention layer of a DeepSeek-V3.2 checkpoint, loaded into `jax_sparse_mla.nnx.MLAAttention`.

A checkpoint is a directory holding `config.json` and `*.safetensors` files (optionally a
`model.safetensors.index.json` naming which file holds which tensor), a single safetensors
file, or any mapping from tensor name to array. Two tensor-name layouts are read, per layer `i`:

======================  ===================================  =====================================
layer attribute         Hugging Face checkpoint              DeepSeek `inference/` (convert.py)
======================  ===================================  =====================================
prefix                  ``model.layers.{i}.self_attn.``      ``layers.{i}.attn.``
``wq_a``                ``q_a_proj``                         ``wq_a``
``q_norm``              ``q_a_layernorm``                    ``q_norm``
``wq_b``                ``q_b_proj``                         ``wq_b``
``wkv_a``               ``kv_a_proj_with_mqa``               ``wkv_a``
``kv_norm``             ``kv_a_layernorm``                   ``kv_norm``
``w_uk`` / ``w_uv``     ``kv_b_proj``                        ``wkv_b``
``wo``                  ``o_proj``                           ``wo``
indexer                 ``indexer.{wq_b,wk,k_norm,weights_proj}`` (both layouts)
FP8 block scales        ``<name>.weight_scale_inv``          ``<name>.scale``
======================  ===================================  =====================================

Weights are PyTorch-style ``[out, in]``. A float8_e4m3fn weight comes with float32 scales, one
per 128 x 128 block (`quantization_config.weight_block_size`), and is dequantized on load
(``weight * scale`` blockwise); bf16/float32 weights load as they are. DeepSeek's attention RoPE
rotates interleaved pairs ``(2i, 2i + 1)`` where the layer rotates halves ``(i, i + 32)``: the
RoPE rows of ``wq_b`` (per head) and ``wkv_a`` are permuted on load, which leaves every
attention logit unchanged. The indexer's RoPE is already in halves (DeepSeek's V3.2 code after
its indexer RoPE fix). ``kv_b_proj`` rows are, per head, ``qk_nope_head_dim`` key rows then
``v_head_dim`` value rows.

Only the attention layer is read: no MoE, embeddings or norms around it. Model-parallel shards
of the `inference/` layout (``model{r}-mp{n}.safetensors`` with n > 1) are not merged.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jax_sparse_mla.formats import FP8_MAX, KVFormat
from jax_sparse_mla.serving.nnx import MLAAttention, MLAConfig
from jax_sparse_mla.serving.yarn import YarnScaling

__all__ = ["SafetensorsCheckpoint", "config_from_deepseek", "deepseek_config", "dequantize_fp8_blocks",
           "layer_tensor_names", "load_deepseek_layer", "open_checkpoint", "quantize_fp8_blocks", "random_layer_tensors",
           "read_safetensors", "rope_halves_permutation", "save_safetensors", "write_checkpoint"]

#: DeepSeek's FP8 weight block (rows, columns) when the config names none.
DEFAULT_BLOCK = (128, 128)

# ---- safetensors ------------------------------------------------------------------------------

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        header = json.loads(f.read(n))
    return header, 8 + n


class SafetensorsCheckpoint(Mapping):
    """Read-only tensors of one or more safetensors files, memory-mapped and read on access."""

    def __init__(self, files):
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for path in map(Path, files):
            header, data_start = _read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self._where[name] = (path, data_start, entry)

    def __getitem__(self, name: str) -> np.ndarray:
        path, data_start, entry = self._where[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, not one of {sorted(_DTYPES)}")
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} holds {end - begin} bytes, its shape {shape} and dtype "
                             f"{entry['dtype']} need {math.prod(shape) * dtype.itemsize}")
        if not shape or 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype, "r", data_start + begin, shape)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def read_safetensors(path) -> SafetensorsCheckpoint:
    """The tensors of one safetensors file (lazily read)."""
    return SafetensorsCheckpoint([path])


def save_safetensors(path, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (numpy arrays, bf16/fp8 through ml_dtypes) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    arrays, offset = [], 0
    for name, value in tensors.items():
        a = np.ascontiguousarray(value)
        if a.dtype not in _NAMES:
            raise ValueError(f"save_safetensors: tensor {name!r} has dtype {a.dtype}, not one of "
                             f"{sorted(str(d) for d in _NAMES)}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in arrays:
            f.write(a.tobytes())


def open_checkpoint(source) -> Mapping[str, np.ndarray]:
    """The tensors (lazily read) of a checkpoint directory, a safetensors file or a mapping."""
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    if path.is_file():
        return read_safetensors(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint: {path} is neither a safetensors file nor a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path}")
    return SafetensorsCheckpoint(files)


# ---- FP8 weight blocks --------------------------------------------------------------------------

def _block_grid(shape, block) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize_fp8_blocks(weight, scale, block=DEFAULT_BLOCK) -> np.ndarray:
    """float32 ``weight * scale`` with one scale per ``block`` of the 2-D FP8 ``weight``
    (the last blocks may be partial); `scale` is the checkpoint's `weight_scale_inv`."""
    weight, scale = np.asarray(weight), np.asarray(scale, np.float32)
    if weight.ndim != 2:
        raise ValueError(f"dequantize_fp8_blocks: weight must be 2-D [out, in], got shape {weight.shape}")
    grid = _block_grid(weight.shape, block)
    if scale.shape != grid:
        raise ValueError(f"dequantize_fp8_blocks: scale shape must be {grid} for weight {weight.shape} in "
                         f"{tuple(block)} blocks, got {scale.shape}")
    per_element = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: weight.shape[0], : weight.shape[1]]
    return weight.astype(np.float32) * per_element


def quantize_fp8_blocks(weight, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn codes and float32 block scales (``amax / 448``) of a 2-D weight: the
    inverse of :func:`dequantize_fp8_blocks`, for writing checkpoints."""
    weight = np.asarray(weight, np.float32)
    rows, cols = _block_grid(weight.shape, block)
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    tiles = padded.reshape(rows, block[0], cols, block[1])
    scale = np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-12) / FP8_MAX
    codes = (tiles / scale[:, None, :, None]).reshape(padded.shape)[: weight.shape[0], : weight.shape[1]]
    return codes.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


# ---- names, config ------------------------------------------------------------------------------

# (layer attribute, Hugging Face name, inference/ name) of each tensor group.
_TENSORS = (("wq_a", "q_a_proj", "wq_a"), ("q_norm", "q_a_layernorm", "q_norm"), ("wq_b", "q_b_proj", "wq_b"),
            ("wkv_a", "kv_a_proj_with_mqa", "wkv_a"), ("kv_norm", "kv_a_layernorm", "kv_norm"),
            ("wkv_b", "kv_b_proj", "wkv_b"), ("wo", "o_proj", "wo"),
            ("wq_idx", "indexer.wq_b", "indexer.wq_b"), ("wk_idx", "indexer.wk", "indexer.wk"),
            ("k_idx_norm", "indexer.k_norm", "indexer.k_norm"),
            ("w_idx_weights", "indexer.weights_proj", "indexer.weights_proj"))
_LAYOUTS = {"hf": ("model.layers.{layer}.self_attn.", 1, "weight_scale_inv"),
            "inference": ("layers.{layer}.attn.", 2, "scale")}


def layer_tensor_names(layer: int, layout: str = "hf") -> dict[str, str]:
    """Layer attribute -> tensor name prefix (add ".weight", ".bias", or the scale suffix)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    prefix, column, _ = _LAYOUTS[layout]
    return {row[0]: prefix.format(layer=layer) + row[column] for row in _TENSORS}


def _expected_shapes(c: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint shape ([out, in] for weights) of each tensor group's weight."""
    h, rope_d, lat = c.n_heads, c.rope_dim, c.latent_dim
    return {"wq_a": (c.q_lora_rank, c.dim), "q_norm": (c.q_lora_rank,),
            "wq_b": (h * (c.qk_nope_head_dim + rope_d), c.q_lora_rank), "wkv_a": (lat + rope_d, c.dim),
            "kv_norm": (lat,), "wkv_b": (h * (c.qk_nope_head_dim + c.v_head_dim), lat),
            "wo": (c.dim, h * c.v_head_dim), "wq_idx": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
            "wk_idx": (c.index_head_dim, c.dim), "k_idx_norm": (c.index_head_dim,),
            "w_idx_weights": (c.index_n_heads, c.dim)}


# MLAConfig field <- config.json key, where they differ only in name.
_CONFIG_KEYS = {"dim": "hidden_size", "n_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank",
                "qk_nope_head_dim": "qk_nope_head_dim", "v_head_dim": "v_head_dim",
                "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
                "index_topk": "index_topk", "rope_theta": "rope_theta"}
_EPS = 1e-6  # the layer's RMSNorm / LayerNorm epsilon (flax's default)


def config_from_deepseek(config, **overrides) -> MLAConfig:
    """The layer config of a DeepSeek-V3.2 `config.json` (a dict or its path); `overrides` set
    further MLAConfig fields (page_size, indexer, tp_axis, ...)."""
    if not isinstance(config, Mapping):
        config = json.loads(Path(config).read_text())
    missing = sorted(k for k in (*_CONFIG_KEYS.values(), "kv_lora_rank", "qk_rope_head_dim") if k not in config)
    if missing:
        raise ValueError(f"config.json: missing keys {missing}")
    fmt = KVFormat.V32
    for key, want in (("kv_lora_rank", fmt.d_nope), ("qk_rope_head_dim", fmt.d_rope)):
        if config[key] != want:
            raise ValueError(f"config.json: {key} must be {want} (the V32 cache's latent and RoPE widths), "
                             f"got {config[key]!r}")
    if not config["q_lora_rank"]:
        raise ValueError(f"config.json: q_lora_rank must be > 0 (the layer has a query LoRA), "
                         f"got {config['q_lora_rank']!r}")
    eps = config.get("rms_norm_eps", _EPS)
    if eps != _EPS:
        raise ValueError(f"config.json: rms_norm_eps must be {_EPS} (the layer's norms), got {eps!r}")
    quant = config.get("quantization_config") or {}
    fields: dict[str, Any] = {f: config[k] for f, k in _CONFIG_KEYS.items()}
    fields.update(fmt="V32", rope_scaling=config.get("rope_scaling"),
                  index_scale_fmt=quant.get("scale_fmt", config.get("scale_fmt")))
    fields.update(overrides)
    return MLAConfig(**fields)


def deepseek_config(c: MLAConfig, block=DEFAULT_BLOCK) -> dict[str, Any]:
    """A DeepSeek-V3.2-style `config.json` dict describing layer config `c` (for writing
    checkpoints; the inverse of :func:`config_from_deepseek`)."""
    out: dict[str, Any] = {k: getattr(c, f) for f, k in _CONFIG_KEYS.items()}
    out.update(kv_lora_rank=c.latent_dim, qk_rope_head_dim=c.rope_dim, rms_norm_eps=_EPS,
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": c.index_scale_fmt, "weight_block_size": list(block)})
    if c.rope_scaling is not None:
        out["rope_scaling"] = {"type": "yarn", **{f: getattr(c.rope_scaling, f) for f in
                                                  YarnScaling.__dataclass_fields__}}
    return out


def rope_halves_permutation(d: int) -> np.ndarray:
    """Row order taking interleaved RoPE pairs ``(2i, 2i + 1)`` to halves ``(i, i + d/2)``."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


# ---- loading ------------------------------------------------------------------------------------

def _detect_layout(tensors: Mapping, layer: int) -> str:
    for layout in _LAYOUTS:
        if layer_tensor_names(layer, layout)["wq_a"] + ".weight" in tensors:
            return layout
    names = [layer_tensor_names(layer, layout)["wq_a"] + ".weight" for layout in _LAYOUTS]
    raise KeyError(f"checkpoint: layer {layer} not found (looked for {names})")


def load_deepseek_layer(source, layer: int = 0, config: MLAConfig | None = None, **overrides) -> MLAAttention:
    """`MLAAttention` with the weights of attention layer `layer` of a DeepSeek-V3.2 checkpoint.

    `source`: a checkpoint directory, a safetensors file, or a mapping name -> array. `config`:
    the layer config; by default read from the directory's `config.json` with `overrides`
    (e.g. `page_size=64`, `indexer="exact"`). Parameters come out float32, unsharded: place
    them with `nnx.get_partition_spec` as for a fresh layer."""
    tensors = open_checkpoint(source)
    block = DEFAULT_BLOCK
    directory = None if isinstance(source, Mapping) else Path(source)
    if directory is not None and (directory / "config.json").is_file():
        raw = json.loads((directory / "config.json").read_text())
        block = tuple((raw.get("quantization_config") or {}).get("weight_block_size", block))
        if config is None:
            config = config_from_deepseek(raw, **overrides)
    if config is None:
        raise ValueError("load_deepseek_layer: pass config= (the source has no config.json)")
    if config.kv_format.name != "V32" or config.window or config.attn_sink:
        raise ValueError(f"load_deepseek_layer: a DeepSeek-V3.2 layer needs fmt='V32', window=0, attn_sink=False, "
                         f"got fmt={config.fmt!r}, window={config.window}, attn_sink={config.attn_sink}")
    layout = _detect_layout(tensors, layer)
    names = layer_tensor_names(layer, layout)
    scale_suffix = _LAYOUTS[layout][2]
    shapes = _expected_shapes(config)

    def get(name, shape):
        if name not in tensors:
            raise KeyError(f"checkpoint: tensor {name!r} is missing")
        value = tensors[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"checkpoint: tensor {name!r} must have shape {shape}, got {tuple(value.shape)}")
        return value

    def weight(key):
        base = names[key]
        w = get(base + ".weight", shapes[key])
        if np.dtype(w.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
            return np.asarray(w, np.float32)
        scale_name = f"{base}.{scale_suffix}"
        return dequantize_fp8_blocks(w, get(scale_name, _block_grid(shapes[key], block)), block)

    c = config
    nope, rope_d, lat = c.qk_nope_head_dim, c.rope_dim, c.latent_dim
    to_halves = rope_halves_permutation(rope_d)
    wq_b = weight("wq_b").reshape(c.n_heads, nope + rope_d, c.q_lora_rank)
    wq_b = np.concatenate([wq_b[:, :nope], wq_b[:, nope:][:, to_halves]], axis=1).reshape(-1, c.q_lora_rank)
    wkv_a = weight("wkv_a")
    wkv_a = np.concatenate([wkv_a[:lat], wkv_a[lat:][to_halves]], axis=0)
    wkv_b = weight("wkv_b").reshape(c.n_heads, nope + c.v_head_dim, lat)

    module = nnx.eval_shape(lambda: MLAAttention(c, rngs=nnx.Rngs(0)))
    values = [  # flax kernels are [in, out]
        (module.wq_a.kernel, weight("wq_a").T), (module.q_norm.scale, weight("q_norm")),
        (module.wq_b.kernel, wq_b.T), (module.wkv_a.kernel, wkv_a.T), (module.kv_norm.scale, weight("kv_norm")),
        (module.w_uk, wkv_b[:, :nope]), (module.w_uv, wkv_b[:, nope:].transpose(0, 2, 1)),
        (module.wo.kernel, weight("wo").T), (module.wq_idx.kernel, weight("wq_idx").T),
        (module.wk_idx.kernel, weight("wk_idx").T), (module.k_idx_norm.scale, weight("k_idx_norm")),
        (module.k_idx_norm.bias, get(names["k_idx_norm"] + ".bias", shapes["k_idx_norm"])),
        (module.w_idx_weights.kernel, weight("w_idx_weights").T),
    ]
    for param, value in values:
        param.set_value(jnp.asarray(value, jnp.float32))
    unset = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(module))
             if isinstance(v, jax.ShapeDtypeStruct)]
    assert not unset, f"parameters the loader does not set: {unset}"  # a new layer parameter, not in the table
    return module


def random_layer_tensors(c: MLAConfig, layer: int = 0, *, seed: int = 0, layout: str = "hf",
                         block=DEFAULT_BLOCK) -> dict[str, np.ndarray]:
    """Random DeepSeek-V3.2-shaped tensors of one attention layer in checkpoint layout (FP8
    projections with block scales, bf16 indexer head weights, float32 norms): synthetic
    weights for tests and demos."""
    rng = np.random.default_rng(seed)
    names = layer_tensor_names(layer, layout)
    scale_suffix = _LAYOUTS[layout][2]
    out: dict[str, np.ndarray] = {}
    for key, shape in _expected_shapes(c).items():
        base = names[key]
        if len(shape) == 1:  # a norm: weights near one (and a small bias for the LayerNorm)
            out[base + ".weight"] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if key == "k_idx_norm":
                out[base + ".bias"] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        w = rng.standard_normal(shape) * shape[1] ** -0.5
        if key == "w_idx_weights":
            out[base + ".weight"] = w.astype(ml_dtypes.bfloat16)
        else:
            out[base + ".weight"], out[f"{base}.{scale_suffix}"] = quantize_fp8_blocks(w, block)
    return out


def write_checkpoint(directory, c: MLAConfig, tensors: Mapping[str, Any], block=DEFAULT_BLOCK) -> Path:
    """Write `config.json` (for `c`) and `tensors` as one safetensors file into `directory`."""
    directory = Path(directory)
    os.makedirs(directory, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(deepseek_config(c, block), indent=2))
    save_safetensors(directory / "model-00001-of-00001.safetensors", tensors, {"format": "pt"})
    return directory

"""The NNX layer as a DeepSeek-V3.2 attention layer: YaRN, the FP8 indexer numerics, the
checkpoint loader, and one prefill + decode step against an independent float64 NumPy
implementation of DeepSeek's equations that shares nothing with the layer but the checkpoint
tensors (interleaved RoPE, FP8 block weights, Hadamard-rotated FP8 indexer)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax")
from jax_sparse_mla.serving import checkpoint as ckpt  # noqa: E402
from jax_sparse_mla.serving import indexer as fp8_indexer  # noqa: E402
from jax_sparse_mla import nnx as jnnx  # noqa: E402
from jax_sparse_mla.serving import yarn  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
V32_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# DeepSeek-V3.2's attention shape (16 heads, latent 512, RoPE 64, nope/v 128, indexer heads of 128,
# top-k 64), a smaller hidden size and fewer indexer heads; 320 and 192 leave partial FP8 blocks.
DEEPSEEK = dict(dim=320, n_heads=16, q_lora_rank=192, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=16,
                index_head_dim=128, index_topk=64, page_size=64, rope_scaling=V32_YARN)
# Indexer values the layer computes in float32 are within ~3e-6 * max|v| of float64 ones here; a
# code counts as ambiguous when its value is within ETA * max|v| of an FP8 rounding edge.
ETA = 2.0 ** -16
# More seeds: JSM_DEEPSEEK_SEEDS=50 runs seeds 0..49.
SEEDS = range(int(os.environ.get("JSM_DEEPSEEK_SEEDS", "1")))


# ---- an independent float64 implementation of DeepSeek's equations ---------------------------

def np_yarn_freqs(dim, theta, scaling):
    """YaRN written from wavelengths: pair i has wavelength 2 pi theta^(2i/dim); pairs making at
    least beta_fast turns over the original context keep their frequency, at most beta_slow
    turns get it divided by factor, a linear ramp between (index bounds floored / ceiled)."""
    i = np.arange(dim // 2, dtype=np.float64)
    base = 1.0 / theta ** (2 * i / dim)
    if scaling is None:
        return base
    ctx = scaling["original_max_position_embeddings"]

    def index_for_turns(turns):  # solve ctx / (2 pi theta^(2i/dim)) = turns for i
        return math.log(ctx / (2 * math.pi * turns), theta) * dim / 2

    lo = max(math.floor(index_for_turns(scaling["beta_fast"])), 0)
    hi = min(math.ceil(index_for_turns(scaling["beta_slow"])), dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    keep = 1 - np.minimum(np.maximum((i - lo) / (hi - lo), 0), 1)
    return keep * base + (1 - keep) * base / scaling["factor"]


def np_mscale(factor, m):
    return 1.0 if factor <= 1 else 1 + 0.1 * m * math.log(factor)


def np_sylvester(d):
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


def np_fp8_quant(v, ue8m0, eta=0.0):
    """Per-vector FP8 of v [..., d] (float64): codes, scales, and the code uncertainty per element
    (how far the code may move if v is off by eta * max|v|) and whether the scale itself may flip."""
    amax = np.maximum(np.abs(v).max(-1), 1e-4)
    a = amax / 448.0
    if ue8m0:
        e = np.ceil(np.log2(a))
        scale = 2.0 ** e
        scale_flips = np.abs(a / 2.0 ** np.round(np.log2(a)) - 1) < eta
    else:
        scale, scale_flips = a, np.zeros(a.shape, bool)
    raw = np.clip(v / scale[..., None], -448, 448)
    codes = raw.astype(FP8).astype(np.float64)
    slack = eta * (amax / scale)[..., None]
    lo = np.clip(raw - slack, -448, 448).astype(FP8).astype(np.float64)
    hi = np.clip(raw + slack, -448, 448).astype(FP8).astype(np.float64)
    return codes, scale, hi - lo, scale_flips


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _qk(q, k):
    """Dot products `[b, s, h, t]` of `q [b, s, h, d]` with `k [b, t, d]` (a BLAS matmul)."""
    b, s, h, d = q.shape
    return (q.reshape(b, s * h, d) @ np.swapaxes(k, 1, 2)).reshape(b, s, h, k.shape[1])


class DeepSeekReference:
    """DeepSeek V3.2's MLA + indexer from checkpoint tensors (Hugging Face names), float64."""

    def __init__(self, tensors, config, layer=0):
        self.c = config
        p = f"model.layers.{layer}.self_attn."

        def w(name):
            weight = tensors[p + name + ".weight"]
            if weight.dtype != FP8:
                return _f64(weight)
            s = _f64(tensors[p + name + ".weight_scale_inv"])
            return _f64(weight) * np.kron(s, np.ones((128, 128)))[: weight.shape[0], : weight.shape[1]]

        self.w = {n: w(n) for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                    "kv_a_layernorm", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk",
                                    "indexer.k_norm", "indexer.weights_proj")}
        self.k_norm_bias = _f64(tensors[p + "indexer.k_norm.bias"])
        scaling = config.get("rope_scaling")
        self.freqs = np_yarn_freqs(config["qk_rope_head_dim"], config["rope_theta"], scaling)
        self.amp = 1.0
        self.scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
        if scaling:
            self.amp = np_mscale(scaling["factor"], scaling["mscale"]) / np_mscale(scaling["factor"],
                                                                                   scaling["mscale_all_dim"])
            self.scale *= np_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2

    def _rot(self, z, pos):
        turn = np.exp(1j * pos[:, :, None] * self.freqs)  # [b, T, d/2]
        return z * self.amp * (turn[:, :, None] if z.ndim == 4 else turn)

    def rope_interleaved(self, x, pos):  # MLA: pairs (2i, 2i+1)
        z = self._rot(x[..., 0::2] + 1j * x[..., 1::2], pos)
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    def rope_halves(self, x, pos):  # indexer: pairs (i, i + d/2)
        d = x.shape[-1]
        z = self._rot(x[..., : d // 2] + 1j * x[..., d // 2:], pos)
        return np.concatenate([z.real, z.imag], -1)

    def run(self, xs, eta):
        """All tokens `xs [b, T, dim]` at positions 0..T-1 (causal)."""
        c, w = self.c, self.w
        b, T, _ = xs.shape
        x = _f64(xs)
        pos = np.broadcast_to(np.arange(T), (b, T))
        rms = lambda v, g: v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * g  # noqa: E731
        h, nope, rope_d, lat = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c[
            "kv_lora_rank"]
        qr = rms(x @ w["q_a_proj"].T, w["q_a_layernorm"])
        q = (qr @ w["q_b_proj"].T).reshape(b, T, h, nope + rope_d)
        self.q_nope, self.q_pe = q[..., :nope], self.rope_interleaved(q[..., nope:], pos)
        kv = x @ w["kv_a_proj_with_mqa"].T
        latent = rms(kv[..., :lat], w["kv_a_layernorm"])
        # The FP8 cache: the bf16 latent (what DeepSeek writes) in 128-dim tiles with power-of-two
        # scales; the RoPE part in bf16.
        latent = latent.astype(ml_dtypes.bfloat16).astype(np.float64)
        codes, scale, _, _ = np_fp8_quant(latent.reshape(b, T, lat // 128, 128), True)
        self.latent = (codes * scale[..., None]).reshape(b, T, lat)
        self.k_pe = self.rope_interleaved(kv[..., lat:], pos).astype(ml_dtypes.bfloat16).astype(np.float64)
        wkv_b = w["kv_b_proj"].reshape(h, nope + c["v_head_dim"], lat)
        self.w_uk, self.w_uv = wkv_b[:, :nope], wkv_b[:, nope:]

        # Indexer: RoPE on the first 64 dims (halves), Hadamard, FP8 per vector.
        hi, d = c["index_n_heads"], c["index_head_dim"]
        ue8m0 = c["quantization_config"]["scale_fmt"] == "ue8m0"
        qi = (qr @ w["indexer.wq_b"].T).reshape(b, T, hi, d)
        qi = np.concatenate([self.rope_halves(qi[..., :rope_d], pos), qi[..., rope_d:]], -1)
        ki = x @ w["indexer.wk"].T
        ki = (ki - ki.mean(-1, keepdims=True)) / np.sqrt(ki.var(-1, keepdims=True) + 1e-6) * w["indexer.k_norm"] \
            + self.k_norm_bias
        ki = np.concatenate([self.rope_halves(ki[..., :rope_d], pos), ki[..., rope_d:]], -1)
        had = np_sylvester(d) / math.sqrt(d)
        qc, qs, dq, q_flip = np_fp8_quant(qi @ had, ue8m0, eta)
        kc, ks, dk, k_flip = np_fp8_quant(ki @ had, ue8m0, eta)
        proj = x @ w["indexer.weights_proj"].T
        wq = proj * hi ** -0.5 * qs * d ** -0.5  # [b, T, hi]
        logits = _qk(qc, kc)
        self.scores = np.einsum("bsht,bsh->bst", np.maximum(logits, 0), wq) * ks[:, None, :]
        # How far each score may move: codes within eta of a rounding edge, float32 sums.
        acode, akc = np.abs(qc), np.abs(kc)
        moved = _qk(dq, akc + dk) + _qk(acode, dk)
        summed = _qk(acode, akc)
        wabs = np.abs(x) @ np.abs(w["indexer.weights_proj"]).T * hi ** -0.5 * qs * d ** -0.5
        bound = np.einsum("bsht,bsh->bst", moved, np.abs(wq)) + 1e-5 * np.einsum("bsht,bsh->bst", summed,
                                                                                   np.abs(wq) + wabs)
        bound = bound * ks[:, None, :]
        bound = np.where(k_flip[:, None, :] | q_flip.any(-1)[:, :, None], np.inf, bound)
        causal = np.arange(T)[None, None, :] <= pos[:, :, None]
        self.scores = np.where(causal, self.scores, -np.inf)
        self.bound = np.where(causal, bound, 0.0)

    def topk(self, k):
        """Per row: the top-k positions (sets) and whether no score within its bound of the
        boundary could swap a selected and an unselected token."""
        b, T, _ = self.scores.shape
        sets, tie_free = {}, np.zeros((b, T), bool)
        for i in range(b):
            for s in range(T):
                sc, bd = self.scores[i, s, : s + 1], self.bound[i, s, : s + 1]
                order = np.argsort(-sc, kind="stable")
                chosen, rest = order[:k], order[k:]
                sets[i, s] = set(chosen.tolist())
                tie_free[i, s] = not len(rest) or (sc[chosen] - bd[chosen]).min() > (sc[rest] + bd[rest]).max()
        return sets, tie_free

    def attend(self, i, s, chosen, wo_t):
        """Output of row (request i, position s) attending to context positions `chosen`."""
        t = np.asarray(sorted(chosen))
        q_lat = np.einsum("hn,hnc->hc", self.q_nope[i, s], self.w_uk)
        logits = (q_lat @ self.latent[i, t].T + self.q_pe[i, s] @ self.k_pe[i, t].T) * self.scale  # [h, n]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        o = (p / p.sum(-1, keepdims=True)) @ self.latent[i, t]  # [h, lat]
        return np.einsum("hc,hvc->hv", o, self.w_uv).reshape(-1) @ wo_t


# ---- YaRN ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim,theta,scaling", [
    (64, 10000.0, V32_YARN),
    (64, 10000.0, dict(V32_YARN, factor=4, beta_fast=16, beta_slow=2, mscale=0.707, mscale_all_dim=0.707)),
    (128, 50000.0, dict(V32_YARN, factor=8, original_max_position_embeddings=8192, mscale_all_dim=0.0)),
    (32, 10000.0, dict(V32_YARN, beta_fast=1000, beta_slow=999)),  # both bounds clip: one-step ramp
    (64, 10000.0, None)])
def test_yarn_frequencies_and_softmax_scale(dim, theta, scaling):
    want = np_yarn_freqs(dim, theta, scaling)
    got = yarn.rope_frequencies(dim, theta, yarn.YarnScaling.from_config(scaling))
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    c = jnnx.MLAConfig(rope_scaling=scaling, rope_theta=theta)
    factor = np_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2 if scaling else 1.0
    assert c.softmax_scale == pytest.approx((64 + 64) ** -0.5 * factor, rel=1e-14)


def test_yarn_of_deepseek_v32():
    """DeepSeek V3.2's config: 21 of the 32 RoPE frequencies change, the softmax scale grows by
    (0.1 ln 40 + 1)^2 = 1.874, cos/sin keep amplitude 1."""
    s = yarn.YarnScaling.from_config(V32_YARN)
    changed = ~np.isclose(yarn.rope_frequencies(64, 1e4, s), yarn.rope_frequencies(64, 1e4))
    assert changed.sum() == 21 and not changed[:11].any()
    assert s.softmax_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    assert round(s.softmax_factor, 3) == 1.874 and s.rope_amplitude == 1.0


def test_rope_applies_yarn_at_long_positions():
    """`rope` rotates halves at the YaRN frequencies (complex numbers, float64, far positions)."""
    s = yarn.YarnScaling.from_config(dict(V32_YARN, mscale=0.9))
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 64)).astype(np.float32)
    pos = np.asarray([[0, 5, 4095], [4096, 70000, 163839]], np.int32)
    got = np.asarray(jnnx.rope(jnp.asarray(x), jnp.asarray(pos), 1e4, s), np.float64)
    z = (x[..., :32] + 1j * x[..., 32:]) * np.exp(1j * pos[..., None, None] * np_yarn_freqs(64, 1e4, V32_YARN))
    z *= np_mscale(40, 0.9) / np_mscale(40, 1.0)
    want = np.concatenate([z.real, z.imag], -1)
    # float32 angles at position 163839: an absolute error of ~1e-2 rad at most.
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(x).max())
    np.testing.assert_allclose(got[0, :2], want[0, :2], atol=1e-5)


def test_yarn_config_errors():
    with pytest.raises(ValueError, match="only type 'yarn'.*got type 'linear'"):
        jnnx.MLAConfig(rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match=r"unknown keys \['beta'\]"):
        jnnx.MLAConfig(rope_scaling=dict(V32_YARN, beta=3))
    with pytest.raises(ValueError, match="beta_fast > beta_slow > 0.*beta_fast=1, beta_slow=32"):
        jnnx.MLAConfig(rope_scaling=dict(V32_YARN, beta_fast=1, beta_slow=32))
    with pytest.raises(ValueError, match="factor must be > 0"):
        yarn.YarnScaling(factor=0, original_max_position_embeddings=4096)
    with pytest.raises(TypeError, match="rope_scaling must be a dict"):
        jnnx.MLAConfig(rope_scaling=40)


# ---- the FP8 indexer pieces ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_hadamard_matches_the_sylvester_matrix(seed):
    rng = np.random.default_rng(seed)
    for d in (1, 2, 8, 64, 128):
        x = rng.standard_normal((3, 5, d)).astype(np.float32)
        got = np.asarray(fp8_indexer.hadamard(jnp.asarray(x)), np.float64)
        want = _f64(x) @ np_sylvester(d) / math.sqrt(d)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(x).max())
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(want, axis=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="power of two, got 96"):
        fp8_indexer.hadamard(jnp.zeros((2, 96)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale_fmt", fp8_indexer.SCALE_FMTS)
def test_quantize_fp8_matches_numpy(seed, scale_fmt):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 128)) * np.exp(rng.uniform(-12, 12, (64, 1)))).astype(np.float32)
    x[0] = 0.0  # the amax floor
    x[1, :4] = [1e30, -1e30, 3.0, 0.0]
    codes, scale = fp8_indexer.quantize_fp8(jnp.asarray(x), scale_fmt)
    assert codes.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and scale.shape == (64,)
    want = np.maximum(np.abs(x).max(-1), np.float32(1e-4)) * np.float32(1 / 448)  # float32, as the spec says
    if scale_fmt == "ue8m0":
        mant, exp = np.frexp(want.astype(np.float64))  # want = mant * 2^exp, mant in [0.5, 1)
        want = np.where(mant == 0.5, 2.0 ** (exp - 1), 2.0 ** exp)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), want)
    raw = np.clip(_f64(x) / want[:, None], -448, 448)
    np.testing.assert_array_equal(np.asarray(codes.astype(jnp.float32)), raw.astype(FP8).astype(np.float32))


def test_write_index_k_puts_codes_and_scales_in_their_slots():
    rng = np.random.default_rng(0)
    index_k = jnp.zeros((3, 4, 128), jnp.float8_e4m3fn)
    index_s = jnp.full((3, 4), -1.0, jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    slots = jnp.asarray([[5, 0, -1], [11, 12, 7]], jnp.int32)  # -1 and 12 (past 3 * 4) are dropped
    new_k, new_s = fp8_indexer.write_index_k(index_k, index_s, k, slots)
    codes, scale = fp8_indexer.quantize_fp8(k)
    flat_k, flat_s = np.asarray(new_k.astype(jnp.float32)).reshape(12, 128), np.asarray(new_s).reshape(12)
    written = {5: (0, 0), 0: (0, 1), 11: (1, 0), 7: (1, 2)}
    for slot in range(12):
        if slot in written:
            np.testing.assert_array_equal(flat_k[slot], np.asarray(codes[written[slot]].astype(jnp.float32)))
            assert flat_s[slot] == scale[written[slot]]
        else:
            assert not flat_k[slot].any() and flat_s[slot] == -1.0
    with pytest.raises(ValueError, match=r"index_k_scale must be float32 \(3, 4\)"):
        fp8_indexer.write_index_k(index_k, jnp.zeros((3, 5)), k, slots)
    with pytest.raises(ValueError, match="index_k must be float8_e4m3fn"):
        fp8_indexer.write_index_k(index_k.astype(jnp.bfloat16), index_s, k, slots)
    with pytest.raises(ValueError, match=r"slots shape must equal k_new.shape\[:-1\] = \(2, 3\), got \(3,\)"):
        fp8_indexer.write_index_k(index_k, index_s, k, slots[0])
    with pytest.raises(ValueError, match="k_new last dim must be 128"):
        fp8_indexer.write_index_k(index_k, index_s, k[..., :64], slots)
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0' or None, got 'e8m0'"):
        fp8_indexer.write_index_k(index_k, index_s, k, slots, "e8m0")


def test_indexer_config_errors():
    with pytest.raises(ValueError, match=r"indexer must be one of \('fp8', 'exact'\), got 'bf16'"):
        jnnx.MLAConfig(indexer="bf16")
    with pytest.raises(ValueError, match="index_head_dim must be a power of two.*got 96"):
        jnnx.MLAConfig(index_head_dim=96)
    jnnx.MLAConfig(index_head_dim=96, indexer="exact")  # no Hadamard there
    with pytest.raises(ValueError, match="index_scale_fmt must be one of"):
        jnnx.MLAConfig(index_scale_fmt="fp32")


# ---- the checkpoint loader -------------------------------------------------------------------------

SMALL = dict(DEEPSEEK, dim=192, n_heads=4, q_lora_rank=160, qk_nope_head_dim=32, v_head_dim=48, index_n_heads=2)


@pytest.mark.parametrize("layout", ["hf", "inference"])
def test_loader_dequantizes_and_permutes_rope_rows(tmp_path, layout):
    """Written by the `safetensors` package over two files with an index, in either name layout:
    each parameter is its tensor dequantized blockwise (computed here with np.kron), transposed,
    with the RoPE rows of wq_b (per head) and wkv_a taken from interleaved to halves order."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    c = jnnx.MLAConfig(**SMALL)
    tensors = ckpt.random_layer_tensors(c, layer=2, seed=3, layout=layout)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for part, chunk in enumerate([names[:half], names[half:]]):
        file = f"model-0000{part + 1}-of-00002.safetensors"
        safetensors_numpy.save_file({n: tensors[n] for n in chunk}, str(tmp_path / file))
        weight_map.update({n: file for n in chunk})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(ckpt.deepseek_config(c)))
    layer = ckpt.load_deepseek_layer(tmp_path, layer=2, page_size=64)
    assert layer.config == c

    prefix, scale = ("model.layers.2.self_attn.", "weight_scale_inv") if layout == "hf" else ("layers.2.attn.", "scale")
    hf = layout == "hf"

    def w(name):
        weight = tensors[prefix + name + ".weight"]
        if weight.dtype != FP8:
            return _f64(weight)
        blocks = np.kron(_f64(tensors[f"{prefix}{name}.{scale}"]), np.ones((128, 128)))
        return _f64(weight) * blocks[: weight.shape[0], : weight.shape[1]]

    def close(got, want):
        np.testing.assert_allclose(np.asarray(got[...], np.float64), want, rtol=1e-6, atol=1e-7)

    wq_b = w("q_b_proj" if hf else "wq_b").reshape(4, 32 + 64, 160)
    halves = np.concatenate([np.arange(0, 64, 2), np.arange(1, 64, 2)])
    close(layer.wq_b.kernel, np.concatenate([wq_b[:, :32], wq_b[:, 32 + halves]], 1).reshape(-1, 160).T)
    wkv_a = w("kv_a_proj_with_mqa" if hf else "wkv_a")
    close(layer.wkv_a.kernel, np.concatenate([wkv_a[:512], wkv_a[512 + halves]]).T)
    wkv_b = w("kv_b_proj" if hf else "wkv_b").reshape(4, 32 + 48, 512)
    close(layer.w_uk, wkv_b[:, :32])
    close(layer.w_uv, np.swapaxes(wkv_b[:, 32:], 1, 2))
    close(layer.wq_a.kernel, w("q_a_proj" if hf else "wq_a").T)
    close(layer.wo.kernel, w("o_proj" if hf else "wo").T)
    close(layer.q_norm.scale, w("q_a_layernorm" if hf else "q_norm"))
    close(layer.kv_norm.scale, w("kv_a_layernorm" if hf else "kv_norm"))
    close(layer.wq_idx.kernel, w("indexer.wq_b").T)
    close(layer.wk_idx.kernel, w("indexer.wk").T)
    close(layer.k_idx_norm.scale, w("indexer.k_norm"))
    close(layer.k_idx_norm.bias, _f64(tensors[prefix + "indexer.k_norm.bias"]))
    close(layer.w_idx_weights.kernel, w("indexer.weights_proj").T)
    assert tensors[prefix + "indexer.weights_proj.weight"].dtype == ml_dtypes.bfloat16


def test_safetensors_writer_is_read_by_the_safetensors_package(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((3, 130)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
               "c": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
               "d": rng.standard_normal((2, 2)).astype(FP8)}
    ckpt.save_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    with safetensors.safe_open(str(tmp_path / "x.safetensors"), "numpy") as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata() == {"format": "pt"}
        np.testing.assert_array_equal(f.get_tensor("a.weight"), tensors["a.weight"])
        np.testing.assert_array_equal(f.get_tensor("b"), tensors["b"])
    back = ckpt.read_safetensors(tmp_path / "x.safetensors")
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name].view(np.uint8), value.view(np.uint8))


def test_loader_errors(tmp_path):
    c = jnnx.MLAConfig(**SMALL)
    tensors = ckpt.random_layer_tensors(c, layer=0)
    p = "model.layers.0.self_attn."
    with pytest.raises(KeyError, match=r"layer 1 not found.*model.layers.1.self_attn.q_a_proj.weight"):
        ckpt.load_deepseek_layer(tensors, 1, c)
    broken = {k: v for k, v in tensors.items() if k != p + "o_proj.weight_scale_inv"}
    with pytest.raises(KeyError, match="'model.layers.0.self_attn.o_proj.weight_scale_inv' is missing"):
        ckpt.load_deepseek_layer(broken, 0, c)
    wrong = dict(tensors, **{p + "kv_a_layernorm.weight": np.ones(256, np.float32)})
    with pytest.raises(ValueError, match=r"kv_a_layernorm.weight' must have shape \(512,\), got \(256,\)"):
        ckpt.load_deepseek_layer(wrong, 0, c)
    wrong = dict(tensors, **{p + "q_a_proj.weight_scale_inv": np.ones((1, 1), np.float32)})
    with pytest.raises(ValueError, match=r"q_a_proj.weight_scale_inv' must have shape \(2, 2\), got \(1, 1\)"):
        ckpt.load_deepseek_layer(wrong, 0, c)
    with pytest.raises(ValueError, match="pass config="):
        ckpt.load_deepseek_layer(tensors, 0)
    with pytest.raises(ValueError, match="fmt='V32', window=0, attn_sink=False.*window=4"):
        ckpt.load_deepseek_layer(tensors, 0, jnnx.MLAConfig(**dict(SMALL, window=4)))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors file"):
        ckpt.load_deepseek_layer(tmp_path, 0, c)
    cfg = ckpt.deepseek_config(c)
    with pytest.raises(ValueError, match="kv_lora_rank must be 512.*got 256"):
        ckpt.config_from_deepseek(dict(cfg, kv_lora_rank=256))
    with pytest.raises(ValueError, match=r"missing keys \['hidden_size'\]"):
        ckpt.config_from_deepseek({k: v for k, v in cfg.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="rms_norm_eps must be 1e-06"):
        ckpt.config_from_deepseek(dict(cfg, rms_norm_eps=1e-5))
    with pytest.raises(ValueError, match="only type 'yarn'"):
        ckpt.config_from_deepseek(dict(cfg, rope_scaling={"type": "dynamic", "factor": 2}))


# ---- one prefill + decode step against the float64 reference ----------------------------------------

def _rows_agree(got, want):
    """Max-abs error relative to the largest reference value, and the cosine."""
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    cos = np.sum(got * want) / np.sqrt(np.sum(got * got) * np.sum(want * want))
    return err, cos


@pytest.mark.parametrize("seed", SEEDS)
def test_layer_equals_deepseek_equations(tmp_path, seed):
    """DeepSeek-shaped random weights written in checkpoint layout, loaded; a 255-token prefill
    then one decode step (batch 2). Top-k: every row where no two scores are within FP8 rounding
    (of the reference's own values) selects exactly the reference's tokens, and >= 95% of the
    rows past top-k do. Output: every row equals the reference attending to the same tokens
    within the FP8 cache's rounding."""
    c = jnnx.MLAConfig(**DEEPSEEK)
    cfg = ckpt.deepseek_config(c)
    tensors = ckpt.random_layer_tensors(c, seed=seed)
    ckpt.write_checkpoint(tmp_path, c, tensors)
    layer = ckpt.load_deepseek_layer(tmp_path, page_size=c.page_size)
    b, T = 2, 256
    xs = np.random.default_rng(seed + 100).standard_normal((b, T, c.dim)).astype(np.float32)
    table, num_blocks = jnnx.make_block_table(b, T, c.page_size, seed=seed)
    cache = jnnx.init_layer_cache(c, num_blocks, b)
    step = jax.jit(lambda x, cache, pos: layer(x, cache, pos, table, return_topk=True))
    # float32 dots (no TF32 on a GPU): the codes the test counts as unambiguous are the float32 ones.
    with jax.default_matmul_precision("float32"):
        y1, cache, top1 = step(jnp.asarray(xs[:, : T - 1]), cache, jnp.zeros((b,), jnp.int32))
        y2, cache, top2 = step(jnp.asarray(xs[:, T - 1:]), cache, jnp.full((b,), T - 1, jnp.int32))
    ys, tops = np.concatenate([y1, y2], 1), np.concatenate([top1, top2], 1)

    ref = DeepSeekReference(tensors, cfg)
    ref.run(xs, eta=ETA)
    want_sets, tie_free = ref.topk(c.index_topk)
    match = np.zeros((b, T), bool)
    worst = (0.0, 1.0)
    wo_t = ref.w["o_proj"].T
    for i in range(b):
        for s in range(T):
            chosen = set(tops[i, s][tops[i, s] >= 0].tolist())
            match[i, s] = chosen == want_sets[i, s]
            err, cos = _rows_agree(ys[i, s].astype(np.float64), ref.attend(i, s, chosen, wo_t))
            worst = (max(worst[0], err), min(worst[1], cos))
    beyond = np.arange(T) >= c.index_topk
    print(f"seed {seed}: match {match[:, beyond].mean():.4f}, tie-free {tie_free[:, beyond].mean():.3f}, "
          f"worst output error {worst[0]:.2e}, cosine {worst[1]:.6f}")
    assert match[:, ~beyond].all()
    assert match[tie_free].all(), np.argwhere(tie_free & ~match)
    assert match[:, beyond].mean() >= 0.95, match[:, beyond].mean()
    assert tie_free[:, beyond].mean() >= 0.05, tie_free[:, beyond].mean()  # the strict check is not vacuous
    assert worst[0] < 1e-2 and worst[1] > 0.9999, worst


# ---- the demo ----------------------------------------------------------------------------------------

def test_layer_demo_writes_loads_and_decodes(tmp_path):
    """`python -m jax_sparse_mla layer`: a synthetic checkpoint written to a directory, then the
    same directory loaded as a given checkpoint, decode the same numbers."""
    from jax_sparse_mla import __main__ as cli
    from jax_sparse_mla.apps import layer_demo

    tiny = ["--context", "40", "--steps", "2", "--dim", "192", "--heads", "4", "--topk", "16", "--batch", "2",
            "--page-size", "16", "--seed", "1"]
    written = layer_demo.run(layer_demo.build_parser().parse_args(tiny + ["--write", str(tmp_path)]))
    assert (tmp_path / "config.json").is_file()
    assert written["tensors"] == 19 and written["fp8_tensors"] == 7
    assert written["rope_freqs_changed"] == 21 and round(written["softmax_factor"], 3) == 1.874
    assert written["finite"] and written["decode_ms"] > 0 and 0.5 <= written["topk_overlap_exact"] <= 1
    read = layer_demo.run(layer_demo.build_parser().parse_args(tiny + ["--checkpoint", str(tmp_path)]))
    for key in ("topk_overlap_exact", "rel_diff_exact", "tensors", "rope_freqs_changed"):
        assert read[key] == written[key], key
    with pytest.raises(SystemExit) as done:
        cli.main(["layer", "--help"])
    assert done.value.code == 0

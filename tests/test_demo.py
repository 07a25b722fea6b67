"""The decode-loop demo and the command line."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
from jax_sparse_mla import demo  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--heads", "8", "--batch", "2", "--steps", "6", "--context", "4", "--topk", "16",
        "--dim", "64", "--vocab", "128", "--page-size", "8", "--check-steps", "3", "--no-progress"]


def _run(*extra):
    return demo.run(demo.build_parser().parse_args(TINY + list(extra)))


def _check(stats, heads_per_device):
    assert stats["checked_steps"] == 3
    assert stats["max_rel_logit_error"] < 3e-2, stats
    assert stats["argmax_agreement"] >= 0.5, stats
    assert stats["generated"].shape == (2, 6)
    assert np.isfinite(stats["tokens_per_s"]) and stats["tokens_per_s"] > 0
    assert 0 < stats["attention_share"]
    assert stats["op_heads_per_device"] == heads_per_device


def test_demo_v32():
    _check(_run(), 8)


def test_demo_model1_sink_window_tp2():
    if len(jax.devices("gpu" if jax.default_backend() == "gpu" else "cpu")) < 2:
        pytest.skip("needs 2 devices of the demo's platform")
    _check(_run("--format", "MODEL1", "--sink", "--window", "4", "--tp", "2"), 4)


def _cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "jax_sparse_mla", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_help():
    top = _cli("--help")
    assert top.returncode == 0 and "demo" in top.stdout and "bench" in top.stdout
    helped = _cli("demo", "--help")
    assert helped.returncode == 0
    for flag in ("--layers", "--heads", "--batch", "--steps", "--context", "--tp"):
        assert flag in helped.stdout
    assert _cli("nonsense").returncode == 2


def test_default_demo_under_a_minute():
    start = time.perf_counter()
    done = _cli("demo", "--no-progress", timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s" in done.stdout and "vs dense attention" in done.stdout
    print(f"default demo: {time.perf_counter() - start:.1f} s\n{done.stdout}")


@pytest.mark.multigpu
def test_demo_two_gpus():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    stats = _run("--tp", "2")
    assert stats["platform"] == "gpu"
    _check(stats, 4)

"""The decode-loop demo and the command line; its DP x TP layouts on the 8 CPU devices and,
marked multigpu, on every GPU of the machine (`mesh_layouts`), each beside one device."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
from jax_sparse_mla.apps import demo  # noqa: E402
from tests.utils import collectives, mesh_layouts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--heads", "8", "--batch", "2", "--steps", "6", "--context", "4", "--topk", "16",
        "--dim", "64", "--vocab", "128", "--page-size", "8", "--check-steps", "3", "--no-progress"]
# Largest relative logit difference allowed against dense attention and against one device (bf16
# queries, FP8 cache entries that a last-bit change upstream can round the other way).
LOGIT_RTOL = 3e-2


def _run(*extra):
    return demo.run(demo.parse_args(TINY + list(extra)))


def _devices():
    """The devices the demo runs on."""
    return jax.devices("gpu" if jax.default_backend() == "gpu" else "cpu")


def _check(stats, heads_per_device, requests_per_device=2):
    assert stats["checked_steps"] == 3
    assert stats["max_rel_logit_error"] < LOGIT_RTOL, stats
    assert stats["argmax_agreement"] >= 0.5, stats
    assert stats["generated"].shape == (2, 6)
    assert np.isfinite(stats["tokens_per_s"]) and stats["tokens_per_s"] > 0
    assert 0 < stats["attention_share"]
    assert stats["op_heads_per_device"] == heads_per_device
    assert stats["op_requests_per_device"] == requests_per_device
    assert 0 < stats["attention_per_device_ms"]


def test_demo_v32():
    _check(_run(), 8)


def test_demo_batch_invariant():
    """--batch-invariant: every plan of the step is a batch-invariant one."""
    stats = _run("--batch-invariant", "--window", "4")
    _check(stats, 8)
    plans = [line for line in stats["step_hlo"].splitlines() if 'custom_call_target="jsm_plan"' in line]
    assert stats["batch_invariant"] and plans and all("batch_invariant = true" in line for line in plans)


def test_demo_model1_sink_window_tp3():
    """TP 3 over 6 heads: 3 does not divide the MLP size (512), which stays replicated."""
    if len(_devices()) < 3:
        pytest.skip("needs 3 devices of the demo's platform")
    _check(_run("--format", "MODEL1", "--sink", "--window", "4", "--heads", "6", "--tp", "3"), 2)


def _check_layout(layout, *extra):
    """One layout of `mesh_layouts(devices, 16)` with --vs-one-device: both runs agree with
    dense attention, the op runs each device's requests and heads, the logits after the prompt
    equal one device's, and the step moves no cache between devices."""
    n = len(_devices())
    layouts = mesh_layouts(n, 16)
    if layout not in layouts:
        pytest.skip(f"no {layout} layout on {n} devices")
    dp, tp = layouts[layout]
    stats, one = demo.measure(demo.parse_args(TINY + ["--heads", "16", "--dp", str(dp), "--tp", str(tp),
                                                      "--vs-one-device", *extra]))
    _check(stats, 16 // tp, 2 // dp)
    _check(one, 16, 2)
    assert (stats["devices"], one["devices"]) == (dp * tp, 1)
    assert stats["max_rel_logit_diff_vs_one_device"] < LOGIT_RTOL, stats["max_rel_logit_diff_vs_one_device"]
    # The per-token caches (latent rows, index keys); the FP8 index keys' per-token scales are
    # as small as one step's new rows in this tiny model, which every DP shard does gather.
    smallest_cache = min(math.prod(shape) for shape in stats["cache_shapes"] if len(shape) == 3)
    moved = collectives(stats["step_hlo"], smallest_cache)
    assert not moved, f"cache-sized collectives in the decode step: {moved}"


def test_demo_dp2_times_tp():
    """DP 2 x TP n/2 on the demo's n devices (DP 2 x TP 4 on the 8 CPU devices), with the
    window cache and a sink."""
    _check_layout("dp2_tp", "--format", "MODEL1", "--sink", "--window", "4")


def test_flags_checked_up_front(capsys):
    for argv, message in ((["--tp", "3"], "argument --tp: must divide --heads (16), got 3"),
                          (["--dp", "3"], "argument --dp: must divide --batch (4), got 3"),
                          (["--vs-one-device"], "argument --vs-one-device: needs a multi-device run"),
                          (["--dp", "0"], "argument --dp: must be >= 1, got 0")):
        with pytest.raises(SystemExit) as exc:
            demo.parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    n = len(_devices())
    if n < 16:  # more devices than there are
        with pytest.raises(SystemExit, match=rf"--dp 2 x --tp 8: needs 16 \w+ devices, got {n}"):
            _run("--heads", "8", "--dp", "2", "--tp", "8")


def _cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "jax_sparse_mla", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_help():
    top = _cli("--help")
    assert top.returncode == 0 and "demo" in top.stdout and "bench" in top.stdout
    helped = _cli("demo", "--help")
    assert helped.returncode == 0
    for flag in ("--layers", "--heads", "--batch", "--steps", "--context", "--tp", "--dp", "--vs-one-device",
                 "--batch-invariant"):
        assert flag in helped.stdout
    assert _cli("nonsense").returncode == 2


def test_default_demo_under_a_minute():
    start = time.perf_counter()
    done = _cli("demo", "--no-progress", timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s" in done.stdout and "vs dense attention" in done.stdout
    print(f"default demo: {time.perf_counter() - start:.1f} s\n{done.stdout}")


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["tp", "dp2_tp"])
def test_demo_layouts_on_all_gpus(layout):
    """TP over every GPU and DP 2 x TP n/2, each beside one GPU."""
    if jax.default_backend() != "gpu" or len(_devices()) < 2:
        pytest.skip("needs 2 GPUs")
    _check_layout(layout)

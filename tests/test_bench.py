"""The benchmark's plumbing on the CPU: its pure-JAX baseline computes the op (so the ratios it
prints are honest), a tiny shape runs end to end, and it refuses GPU-sized runs without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import bench, reference, trace_summary
from tests.utils import assert_lse_close, assert_out_close, make_case, soften


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_xla_gather_baseline_matches_reference(fmt):
    rng = np.random.default_rng()
    # bf16 probabilities, like the GPU path: FlashMLA-like |V| (see soften in tests/utils.py).
    case = soften(make_case(rng, fmt, b=2, s_q=2, h_q=16, topk=64, page_size=16, num_blocks=8, extra_topk=32,
                            extra_page_size=8, extra_num_blocks=4, with_sink=True, sm_scale=0.05))
    got = jax.jit(bench.xla_gather_decode, static_argnames=("sm_scale",))(
        case["q"], case["kv_cache"], case["indices"], case["attn_sink"], case["extra_kv_cache"],
        case["extra_indices"], sm_scale=0.05)
    want = reference.sparse_mla_decode(**case)
    assert_out_close(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
    assert_lse_close(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("shape", [
    bench.Shape("V32", 16, 1, 2, 64, page=16, s_k=256),
    bench.Shape("MODEL1", 16, 2, 2, 32, page=16, s_k=128, extra_topk=40, extra_page=8, extra_s_k=96),
], ids=lambda s: s.name)
def test_tiny_shape_runs(shape):
    row = bench.run_shape(shape, iters=1)
    assert row["shape"] == shape.name and row["us"] > 0 and row["tflops"] > 0 and row["gbs"] > 0
    assert "|" in bench.table([row])


def test_refuses_cpu_without_flag(capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("a GPU is present")
    assert bench.main(["--shapes", "v32_h128_s2_b1_k2048"]) == 2
    assert "--allow-cpu" in capsys.readouterr().err


def test_trace_summary_splits_device_time():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
    ]
    events = meta + [
        {"ph": "X", "pid": 1, "name": "host work", "ts": 0.0, "dur": 500.0},
        {"ph": "X", "pid": 2, "name": "decode_kernel", "ts": 10.0, "dur": 40.0},
        {"ph": "X", "pid": 2, "name": "combine_kernel", "ts": 45.0, "dur": 10.0},  # overlaps: busy 10..55
        {"ph": "X", "pid": 2, "name": "decode_kernel", "ts": 70.0, "dur": 40.0},  # idle 55..70
    ]
    s = trace_summary.summarize_events(events)
    assert s["kernels"]["decode_kernel"] == {"count": 2, "total_us": 80.0}
    assert s["kernels"]["combine_kernel"]["count"] == 1 and "host work" not in s["kernels"]
    assert (s["span_us"], s["busy_us"], s["idle_us"]) == (100.0, 85.0, 15.0)
    text = trace_summary.format_summary(s, calls=2)
    assert "50.0 µs of device span" in text and "decode_kernel" in text
    assert "no device events" in trace_summary.format_summary(trace_summary.summarize_events(meta[:1]), 1)


def test_run_shape_trace_on_cpu(tmp_path):
    """--trace writes a Perfetto trace and reports it; the CPU backend has no device events."""
    row = bench.run_shape(bench.Shape("V32", 16, 1, 2, 64, page=16, s_k=256), iters=1, xla=False,
                          reference_path=False, trace_dir=str(tmp_path))
    assert row["trace"]["file"].startswith(str(tmp_path)) and row["trace"]["calls"] == row["sets"]
    assert row["trace"]["kernels"] == {} and "no device events" in row["trace"]["text"]

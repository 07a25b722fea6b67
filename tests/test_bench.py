"""The benchmark's plumbing on the CPU: its pure-JAX baseline computes the op (so the ratios it
prints are honest), a tiny shape runs end to end, it refuses GPU-sized runs without a GPU, and its
device time (profiler span) leads where the profiler gives one and is replaced by wall time, said
so, where it does not."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla import bench, reference
from jax_sparse_mla.apps import trace_summary
from tests.utils import assert_lse_close, assert_out_close, fresh_rng, make_case, soften


@pytest.mark.parametrize("fmt", ["V32", "MODEL1"])
def test_xla_gather_baseline_matches_reference(fmt):
    rng = fresh_rng()
    # bf16 probabilities, like the GPU path: FlashMLA-like |V| (see soften in tests/utils/cases.py).
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
    for prefix in ("", "xla_gather_", "xla_ref_"):
        assert row[f"{prefix}wall_us"] > 0 and row[f"{prefix}timing"] in ("device", "wall")
        assert row[f"{prefix}us"] == row[f"{prefix}{row[prefix + 'timing']}_us"]
    assert len(_table_line(bench.table([row]), shape.name)) == 11


def test_batch_invariant_runs():
    row = bench.run_shape(bench.Shape("V32", 16, 1, 2, 64, page=16, s_k=256), iters=1, xla=False,
                          reference_path=False, batch_invariant=True)
    assert row["batch_invariant"] is True and row["us"] > 0


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


TINY = bench.Shape("V32", 16, 1, 2, 64, page=16, s_k=256)


@pytest.fixture
def few_calls(monkeypatch):
    """8 calls per timing instead of 32 (the L2 rule wants many sets of tiny shapes): faster compiles."""
    monkeypatch.setattr(bench, "_sets_for", lambda shape: 2)
    return bench.CALLS_PER_TIMING


def test_run_shape_trace_on_cpu(tmp_path):
    """--trace keeps the Perfetto traces; the CPU backend records no device events, so the row falls
    back to wall time and says why."""
    row = bench.run_shape(TINY, iters=1, xla=False, reference_path=False, trace_dir=str(tmp_path))
    assert trace_summary.latest_trace_file(str(tmp_path / TINY.name)) is not None
    if row["timing"] == "device":  # a jax whose CPU backend reports device events
        assert row["trace"]["file"].startswith(str(tmp_path)) and row["us"] == row["device_us"] > 0
    else:
        assert row["trace"] == {"error": bench.NO_DEVICE_EVENTS}
        assert row["device_us"] is None and row["us"] == row["wall_us"] > 0
        assert row["device_error"] == row["trace"]["error"]


def test_fallback_when_profiler_fails(monkeypatch, few_calls):
    """No CUPTI (or any profiler error): wall time for our op and the XLA paths, and the table says so."""
    def broken(*args, **kwargs):
        raise RuntimeError("CUPTI could not be loaded")

    monkeypatch.setattr(jax.profiler, "trace", broken)
    row = bench.run_shape(TINY, iters=1, xla=True, reference_path=False)
    assert row["timing"] == "wall" and row["device_us"] is None and row["us"] == row["wall_us"] > 0
    assert "CUPTI could not be loaded" in row["device_error"] and "profiler failed" in row["device_error"]
    assert row["xla_gather_timing"] == "wall" and row["xla_gather_us"] == row["xla_gather_wall_us"] > 0
    line, note = _table_line(bench.table([row]), row["shape"]), _note(bench.table([row]))
    assert line[1] == "-" and float(line[2]) == pytest.approx(row["wall_us"], abs=0.05)
    assert float(line[6]) == pytest.approx(row["xla_gather_us"] / row["wall_us"], abs=0.005)
    assert TINY.name in note and "CUPTI could not be loaded" in note and "wall" in note


def test_device_time_leads(monkeypatch, few_calls):
    """With a device span from the profiler (faked here: the CPU has none), `us`, TFLOP/s, GB/s and the
    ratio to the gather-first path use device time; wall time is kept beside; the traces go to a
    temporary directory that is removed."""
    seen = []

    def fake_summary(path):  # 8+ calls: ours spans 40 µs each, the gather path 100 µs, the reference 900
        seen.append(path)
        calls = 1 if "xla_ref" in path else few_calls
        per = 100.0 if "xla_gather" in path else 900.0 if "xla_ref" in path else 40.0
        return {"kernels": {"k": {"count": calls, "total_us": per * calls}}, "span_us": per * calls,
                "busy_us": per * calls, "idle_us": 0.0}

    monkeypatch.setattr(trace_summary, "summarize_file", fake_summary)
    monkeypatch.setattr(bench, "_time", lambda fn, args, iters, calls: 250.0)  # wall: dispatch-bound
    row = bench.run_shape(TINY, iters=1)
    assert len(seen) == 3 and all(not os.path.exists(p) for p in seen)
    assert row["sets"] == few_calls
    assert (row["timing"], row["us"], row["device_us"], row["wall_us"]) == ("device", 40.0, 40.0, 250.0)
    assert "file" not in row["trace"] and row["trace"]["kernels"] == {"k": 40.0}
    flop, nbytes = bench.cost(TINY, 0)
    assert row["tflops"] == pytest.approx(flop / 40.0 * 1e-6)
    assert (row["xla_gather_us"], row["xla_gather_timing"], row["xla_gather_wall_us"]) == (100.0, "device", 250.0)
    assert (row["xla_ref_us"], row["xla_ref_timing"]) == (900.0, "device")
    text = bench.table([row])
    line = _table_line(text, row["shape"])
    assert line[1:3] == ["40.0", "250.0"] and line[5:9] == ["100.0", "2.50", "900.0", "22.50"]
    assert "note:" not in text
    json.dumps(row)  # --json writes the rows as they are


def test_table_marks_wall_ratio_in_device_row():
    """Our op has device time but the gather path does not: its ratio is wall over wall, marked."""
    row = dict(shape="s", us=40.0, timing="device", device_us=40.0, wall_us=250.0, tflops=1.0, gbs=2.0,
               xla_gather_us=500.0, xla_gather_timing="wall", xla_gather_device_us=None,
               xla_gather_wall_us=500.0, xla_gather_device_error="profiler failed: X",
               xla_ref_us=None, xla_ref_error="OOM", flashmla_us=20.0)
    line = _table_line(bench.table([row]), "s")
    assert line[5:9] == ["500.0 (wall)", "2.00 (wall)", "-", "-"] and line[9:] == ["20.0", "2.00"]


def test_main_json_keys_and_columns(tmp_path, capsys, few_calls):
    """End to end on the CPU with a custom tiny shape: both columns, and the JSON keys other scripts read."""
    out = tmp_path / "rows.json"
    assert bench.main(["--allow-cpu", "--shapes", "v32_h16_s1_b2_k64_p16_n256", "--iters", "1", "--no-xla",
                       "--no-reference", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| shape | device µs/call | wall µs/call | TFLOP/s |" in text
    (row,) = json.loads(out.read_text())
    assert row["shape"] == "v32_h16_s1_b2_k64_p16_n256"
    assert {"us", "device_us", "wall_us", "timing", "tflops", "gbs"} <= row.keys()
    assert row["us"] == (row["device_us"] if row["timing"] == "device" else row["wall_us"])
    assert (row["timing"] == "wall") == (f"note: {row['shape']}: no device time" in text)


def test_shape_from_name():
    assert bench.shape_from_name("v32_h128_s2_b128_k2048") is bench.PRESETS["v32_h128_s2_b128_k2048"]
    s = bench.shape_from_name("model1_h16_s2_b2_k32_x40_p16_n128")
    assert (s.fmt, s.h_q, s.s_q, s.b, s.topk, s.extra_topk, s.page, s.s_k) == ("MODEL1", 16, 2, 2, 32, 40, 16, 128)
    assert s.name == "model1_h16_s2_b2_k32_x40_p16_n128"
    assert bench.shape_from_name("model1_h16_s2_b2_k32_x40_p16_n128_i7").invalid_tail == 7
    for bad, why in [("v32_h16", "unknown shape"), ("v32_h16_s1_b2_k64_x8", "extra cache"),
                     ("v32_h16_s1_b2_k64_n32", "fewer than topk"), ("model1_h16_s1_b2_k64_x40_i40", "list empty")]:
        with pytest.raises(ValueError, match=why):
            bench.shape_from_name(bad)


def test_invalid_tails():
    """_iN: the last N entries of every list are -1 (a short context's padded list); the rest are
    distinct tokens of the request, and only they count as bytes read or products."""
    shape = bench.shape_from_name("model1_h16_s2_b3_k64_x40_p16_n128_i5")
    inp = bench.make_inputs(shape, sets=2)
    for lists, topk in ((inp.idxs, 64), (inp.extra_idxs, 40)):
        for idx in map(np.asarray, lists):
            assert (idx[..., topk - 5:] == -1).all() and (idx[..., :topk - 5] >= 0).all()
            for row in idx.reshape(-1, topk):
                assert len(set(row[:topk - 5])) == topk - 5
    assert inp.distinct_tokens <= 3 * 2 * (64 - 5 + 40 - 5)
    flop, _ = bench.cost(shape, inp.distinct_tokens)
    full, _ = bench.cost(bench.shape_from_name("model1_h16_s2_b3_k64_x40_p16_n128"), inp.distinct_tokens)
    assert flop / full == pytest.approx((64 + 40 - 10) / (64 + 40))


def _table_line(text, shape):
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {shape} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def _note(text):
    (note,) = [ln for ln in text.splitlines() if ln.startswith("note:")]
    return note

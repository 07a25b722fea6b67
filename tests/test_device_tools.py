"""The device-side tools in benchmarks/ still build against the current kernel sources (their
runs need a GPU; CI has nvcc): the standalone decode harness the sanitizers run on, and the
minimal kernels that reproduce racecheck's reports (named-barrier and mbarrier hand-offs)."""

import shutil
import subprocess
from pathlib import Path

import jax.ffi
import pytest

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")
ARCH = "-gencode=arch=compute_90a,code=sm_90a"


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_decode_harness_builds(tmp_path):
    cmd = [NVCC, "-std=c++17", "-O1", ARCH, "--expt-relaxed-constexpr", f"-I{jax.ffi.include_dir()}",
           f"-I{ROOT / 'ffi'}", "-o", str(tmp_path / "decode_harness"),
           str(ROOT / "benchmarks/sanitizer_repro/decode_harness.cu"), str(ROOT / "ffi/cuda/decode_launch.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["named_barrier_handoff", "mbarrier_handoff"])
def test_reproducer_builds(tmp_path, name):
    cmd = [NVCC, ARCH, "-o", str(tmp_path / name), str(ROOT / f"benchmarks/sanitizer_repro/{name}.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

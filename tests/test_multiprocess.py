"""Beyond one process: two local processes (4 CPU devices each, gloo collectives) joined by
`jax.distributed.initialize` run the sharded decode over the global 8-device mesh; the gathered
results equal the single-process op.

The workers are this file run as `python -m tests.test_multiprocess PROCESS_ID PORT OUT SEED`.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CASE = dict(b=4, s_q=2, h_q=32, topk=64, page_size=32, num_blocks=8, extra_topk=16, with_lengths=True,
            with_sink=True, sm_scale=None)


def _case(seed):
    from tests.utils import make_case

    return make_case(np.random.default_rng(seed), "V32", **CASE)


def _worker(process_id: int, port: int, out_dir: str, seed: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=120)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    import jax_sparse_mla as jsm
    from jax_sparse_mla import sharding

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    case = {k: (np.asarray(v) if k != "sm_scale" else v) for k, v in _case(seed).items()}

    def global_array(x, named):
        return jax.make_array_from_callback(x.shape, named, lambda index: x[index])

    results = {}
    for name, (dp, tp) in {"dp2_tp4": (2, 4), "tp8": (1, 8)}.items():
        mesh = Mesh(np.asarray(jax.devices()).reshape(dp, tp), ("dp", "tp"))
        shardings = sharding.decode_shardings(mesh, batch_axis="dp" if dp > 1 else None, head_axis="tp")
        args = {k: global_array(v, shardings[k]) for k, v in case.items()}
        out, lse = jax.jit(jsm.sparse_mla_decode)(**args)
        results[f"{name}_out"] = np.asarray(multihost_utils.process_allgather(out, tiled=True), np.float32)
        results[f"{name}_lse"] = np.asarray(multihost_utils.process_allgather(lse, tiled=True))
    # shard_map over the global mesh: requests split over dp, heads over tp, the cache replicated.
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("dp", "tp"))
    f = jax.jit(sharding.shard_map_decode(mesh, batch_axis="dp", head_axis="tp"))
    shardings = sharding.decode_shardings(mesh, batch_axis="dp", head_axis="tp")
    out, lse = f(**{k: global_array(v, shardings[k]) for k, v in case.items()})
    results["shard_map_out"] = np.asarray(multihost_utils.process_allgather(out, tiled=True), np.float32)
    results["shard_map_lse"] = np.asarray(multihost_utils.process_allgather(lse, tiled=True))
    if process_id == 0:
        np.savez(os.path.join(out_dir, "results.npz"), **results)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_single_process(tmp_path):
    import jax
    import jax.numpy as jnp

    import jax_sparse_mla as jsm
    from tests.utils import assert_lse_close, assert_out_close

    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"seed={seed}")
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_multiprocess", str(i), str(port), str(tmp_path),
                               str(seed)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:] if i < len(logs) else ''}"

    got = np.load(tmp_path / "results.npz")
    case = _case(seed)
    with jax.default_device(jax.devices("cpu")[0]):
        want_out, want_lse = jax.jit(jsm.sparse_mla_decode)(**case)
    want_out = np.asarray(want_out.astype(jnp.float32))
    for name in ("dp2_tp4", "tp8", "shard_map"):
        assert_out_close(got[f"{name}_out"], want_out)
        assert_lse_close(got[f"{name}_lse"], np.asarray(want_lse))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))

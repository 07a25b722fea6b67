"""README's Python example runs as written and prints its shapes and agreement with the
reference, as README shows (on the CPU, where README's printed output comes from)."""

import contextlib
import io

import jax
import numpy as np

from tests.utils import REPO_ROOT, assert_lse_close, assert_out_close


def _blocks(lang):
    """README's fenced blocks whose info string is `lang`, in order."""
    blocks, body, info = [], None, ""
    for line in (REPO_ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if body is None:
                body, info = [], line[3:].strip()
            else:
                if info == lang:
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def test_readme_example():
    # The Example section's block: the one that checks itself against the reference.
    (example,) = [b for b in _blocks("python") if "reference.sparse_mla_decode" in b]
    namespace = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), jax.default_device(jax.devices("cpu")[0]):
        exec(compile(example, "README.md", "exec"), namespace)
    lines = printed.getvalue().splitlines()
    assert lines[0] == "out (4, 1, 128, 512) bfloat16 | lse (4, 128, 1) float32", lines
    out, ref_out = (np.asarray(namespace[k]).astype(np.float32) for k in ("out", "ref_out"))
    assert_out_close(out, ref_out)
    assert_lse_close(np.asarray(namespace["lse"]), np.asarray(namespace["ref_lse"]))
    # README shows the same lines (the differences' last digits may vary with the CPU).
    (shown,) = [b for b in _blocks("") if b.startswith("out (")]
    assert [line.split(":")[0] for line in shown.splitlines()] == [line.split(":")[0] for line in lines]

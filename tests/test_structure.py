"""The package's structure: no import cycle among its modules, and the FFI binding of the decode
call in C++ takes the operands and attributes in the order `jax_sparse_mla/op/_operands.py` declares."""

import ast
import re
from pathlib import Path

from jax_sparse_mla.op._operands import DecodeOperands, DecodeStatic
from jax_sparse_mla.formats import KVFormat

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_sparse_mla"
# Built, not in the source tree; it imports nothing of the package.
EXTENSION = "jax_sparse_mla._jax_sparse_mla"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """The package modules `path` imports, anywhere in it (function-local imports included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports the module; `from pkg import name`, the package.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def test_no_import_cycle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths} | {EXTENSION}
    graph = {_module_name(p): _imports(p, modules) for p in paths} | {EXTENSION: set()}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def _bind_decode() -> str:
    text = (ROOT / "ffi" / "common" / "problem.h").read_text()
    return text[text.index("auto bind_decode("):text.index("auto bind_combine(")]


def test_bind_decode_operands_match_declaration():
    """bind_decode names each operand in a comment after its `.Arg<...>()`."""
    names = re.findall(r"\.template Arg<[^\n]*\(\)\s*//\s*(\w+)", _bind_decode())
    assert tuple(names) == DecodeOperands._fields


def test_bind_decode_attributes_match_declaration():
    static = DecodeStatic(sm_scale=0.1, fmt=KVFormat.V32, page_size=64, extra_page_size=1, has_sink=False,
                          has_extra=False, sink_per_request=False, plan_parts=None, batch_invariant=False)
    names = re.findall(r'\.template Attr<\w+>\("(\w+)"\)', _bind_decode())
    assert tuple(names) == tuple(static.ffi_attributes())


def test_old_public_paths_still_import():
    """Module paths users (and FlashMLA's side-by-side harness: `from jax_sparse_mla import bench,
    ops`) imported before the package was grouped keep working, as the same objects."""
    import jax_sparse_mla as jsm
    from jax_sparse_mla import bench, nnx, ops, sharding
    from jax_sparse_mla.apps import bench as apps_bench
    from jax_sparse_mla.serving import nnx as serving_nnx, sharding as serving_sharding

    assert (bench, nnx, sharding) == (apps_bench, serving_nnx, serving_sharding)
    assert ops.plan_decode is jsm.plan_decode and ops.sparse_mla_decode is jsm.sparse_mla_decode
    assert ops.DecodePlan is jsm.DecodePlan

"""Data flows one way: models -> policies -> executor -> io in what they compute, and in
imports each layer uses only itself and the layers below it (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "offload"

# lowest first; a module may import its own layer and any layer below
LAYERS = [
    ("base", ["errors", "config", "presets", "sampling"]),
    ("kernels", ["kernels"]),
    ("models", ["models", "batch"]),
    ("io", ["io"]),
    ("policies", ["policies"]),
    ("executor", ["executor", "runner", "parallel"]),
    (
        "api",
        [
            "engine",
            "front",
            "planning",
            "decode_loop",
            "jobs",
            "openai_batch",
            "resultlog",
            "args",
            "outputs",
            "data_parallel",
        ],
    ),
    ("cli", ["cli", "bench"]),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def _top(module: str) -> str:
    """`offload.io.store` -> `io`; `offload.engine` -> `engine`."""
    return module.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every `offload.*` module the file imports, at any depth (functions included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "offload":  # from offload import io
                names = [f"offload.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.startswith("offload.")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("offload.")]
    return out


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package root re-exports the public API
        out.append((parts[0], path))
    return out


def test_every_module_has_a_layer():
    unknown = sorted({top for top, _ in _modules()} - RANK.keys())
    assert not unknown, f"give these modules a layer in LAYERS: {unknown}"


def test_no_layer_imports_a_higher_one():
    upward = []
    for top, path in _modules():
        for line, module in _imports(path):
            target = _top(module)
            assert target in RANK, f"{path}:{line} imports {module}, which has no layer"
            if RANK[target] > RANK[top]:
                upward.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} ({LAYERS[RANK[top]][0]}) "
                    f"imports {module} ({LAYERS[RANK[target]][0]})"
                )
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk finds imports inside functions, so a lazy upward import is caught too."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from offload.executor.executor import Executor\n")
    assert _imports(probe) == [(2, "offload.executor.executor")]

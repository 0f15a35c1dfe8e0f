"""Data flows one way: models -> policies -> executor -> io in what they compute, and in
imports each layer uses only itself and the layers below it (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "offload"

# lowest first; a module may import its own layer and any layer below
LAYERS = [
    ("core", ["core"]),
    ("kernels", ["kernels"]),
    ("models", ["models"]),
    ("io", ["io"]),
    ("policies", ["policies"]),
    ("executor", ["executor"]),
    ("parallel", ["parallel"]),
    ("api", ["api"]),
    ("jobs", ["jobs"]),
    ("cli", ["cli"]),
    # vLLM's import paths (vllm.utils, vllm.outputs, vllm.engine.arg_utils, vllm.v1.metrics,
    # vllm.distributed): re-exports only
    ("vllm paths", ["utils", "outputs", "engine", "v1", "distributed"]),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def _top(module: str) -> str:
    """`offload.io.store` -> `io`; `offload.api.llm` -> `engine`."""
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
        assert len(parts) > 1, f"{path}: a module at the top of the package belongs in a layer"
        out.append((parts[0], path))
    return out


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The `offload` modules a file imports when it runs (`if TYPE_CHECKING:` left out);
    `from offload.x import y` counts as importing `offload.x.y` where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known}


def _import_circles() -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (Tarjan)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _runtime_imports(p, set(paths)) - {name} for name, p in paths.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return circles


def test_no_import_circle():
    circles = _import_circles()
    assert not circles, "modules that import each other: " + "; ".join(map(str, circles))


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

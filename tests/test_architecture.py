"""The package's shape, as docs/architecture.md describes it: layers that import only downwards, no
import cycles, no function longer than 80 lines, and the 0.1 import paths still working."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_hybrid_ep"

# docs/architecture.md, "Layers": a module may import its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("errors", "state")),
    ("configuration", ("config", "parallel.topology")),
    ("process groups", ("parallel",)),
    ("token exchange", ("dispatch",)),
    ("placement", ("planning.placement",)),
    ("MoE layer", ("moe",)),
    ("orchestration", ("parallelize",)),
    ("artifacts and planning", ("checkpoint", "inference", "memory", "metrics", "planning")),
    ("entry points", ("integrations", "hub", "cli", "_compat", "")),
]
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer_of(module: str) -> int:
    """The layer of a module (relative to the package): the longest matching prefix wins."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or prefix == "") and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, module
    return best


def _imports(path: Path) -> set[str]:
    """Package modules ``path`` imports at run time (module level or inside functions; imports under
    ``if TYPE_CHECKING:`` are for annotations only and not counted). ``from . import x`` counts as
    importing the submodule ``x`` when there is one."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    annotation_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in annotation_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("hf_hybrid_ep"):
                target = node.module.removeprefix("hf_hybrid_ep").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if _exists(sub) else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hf_hybrid_ep."):
                    found.add(alias.name.removeprefix("hf_hybrid_ep."))
    found.discard(module)
    return found


def _exists(module: str) -> bool:
    path = PACKAGE.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_imports_only_its_layer_and_below():
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            if _layer_of(target) > _layer_of(module):
                wrong.append(f"{module} ({LAYERS[_layer_of(module)][0]}) imports {target} "
                             f"({LAYERS[_layer_of(target)][0]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    # a package imports its own submodules to re-export them; that is not a cycle of the code
    edges = {m: {t for t in ts if t in graph and not (m == "" or t.startswith(m + ".") and m != t)}
             for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_layers_classify_modules_as_the_docs_say():
    """The layer check can fail: these imports would be upward ones."""
    assert _layer_of("parallel.grads") < _layer_of("moe.layer") < _layer_of("parallelize")
    assert _layer_of("planning.placement.traffic") < _layer_of("moe.rebalance") < _layer_of("planning.planner")
    assert _layer_of("errors") == 0 and _layer_of("") == len(LAYERS) - 1


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_top_level_holds_at_most_a_dozen_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 12, modules


@pytest.mark.parametrize("old", sorted(importlib.import_module("hf_hybrid_ep._compat").MOVED))
def test_old_import_paths_still_work(old):
    from hf_hybrid_ep._compat import MOVED

    sys.modules.pop(old, None)  # the alias only; its successor stays imported
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught)
    successors = [importlib.import_module(name) for name in MOVED[old]]
    assert getattr(importlib.import_module("hf_hybrid_ep"), old.rpartition(".")[2]) is module  # hep.cache, ...
    if len(successors) == 1:
        assert module is successors[0]
    for successor in successors:
        public = [n for n in dir(successor) if not n.startswith("_")]
        assert all(getattr(module, n) is getattr(successor, n) for n in public if hasattr(module, n))
        assert any(hasattr(module, n) for n in public)

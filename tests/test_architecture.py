"""The package's shape, as docs/architecture.md describes it: layers that import only downwards (imports for
type annotations included), no import cycles, ``parallel/`` and ``dispatch/`` blind to the model, every
dispatcher backend on the one protocol, no function longer than 80 lines, no logic written twice."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_hybrid_ep"

# docs/architecture.md, "Layers": a module may import its own layer and the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("errors",)),
    ("configuration", ("config", "parallel.topology")),
    ("process groups", ("parallel",)),
    ("token exchange", ("dispatch",)),
    ("placement", ("planning.placement",)),
    ("quantized weights", ("quant",)),
    ("checkpoint files", ("checkpoint",)),
    ("MoE layer", ("moe",)),
    ("orchestration", ("engine",)),
    ("model I/O and artifacts", ("model_io", "inference", "memory", "metrics", "planning")),
    ("entry points", ("integrations", "pretrained", "hub", "cli", "")),
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
    """Package modules ``path`` imports: at module level, inside functions and under ``if TYPE_CHECKING:`` (an
    import for annotations is a dependency of the reader too). ``from . import x`` counts as importing the
    submodule ``x`` when there is one."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
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
    edges = {m: {t for t in ts if t in graph and not (m == "" or t.startswith(m + "."))} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:  # on the current path
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, [" -> ".join(c) for c in cycles]


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the packages outside hf_hybrid_ep that ``path`` imports (anywhere in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if not name.startswith("hf_hybrid_ep")}


def test_process_groups_and_token_exchange_do_not_know_the_model():
    """parallel/ and dispatch/ receive plain data: no engine state, no MoE layer, no transformers, and the
    dispatchers no modules at all."""
    wrong = []
    for sub in ("parallel", "dispatch"):
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            name = _module_name(path)
            wrong += [f"{name} imports {t}" for t in _imports(path) if t.split(".")[0] in ("engine", "moe")]
            external = _external_imports(path)
            wrong += [f"{name} imports {t}" for t in external if t.split(".")[0] == "transformers"]
            if sub == "dispatch":
                wrong += [f"{name} imports {t}" for t in external if t == "torch.nn" or t.startswith("torch.nn.")]
    assert not wrong, wrong


def test_every_dispatcher_backend_implements_the_protocol():
    import inspect

    from hf_hybrid_ep.config import DISPATCHER_BACKENDS
    from hf_hybrid_ep.dispatch import BACKENDS
    from hf_hybrid_ep.dispatch.protocol import Dispatcher

    assert set(BACKENDS) == set(DISPATCHER_BACKENDS) - {"auto"}
    methods = [n for n in ("plan", "dispatch", "dispatch_async", "combine", "combine_async") if hasattr(Dispatcher, n)]
    assert len(methods) == 5
    for name, cls in BACKENDS.items():
        assert cls.name == name
        for method in methods:
            want = list(inspect.signature(getattr(Dispatcher, method)).parameters)
            got = list(inspect.signature(getattr(cls, method)).parameters)
            assert got == want, (name, method, got, want)


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


def _logic_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, stripped text)`` of the lines that carry logic, the way pylint's similarity checker
    counts them with ``--ignore-docstrings --ignore-imports --ignore-signatures --ignore-comments``:
    no blank lines, comments, docstrings, import statements, ``def`` / ``class`` signatures or decorators."""
    text = path.read_text()
    tree = ast.parse(text)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])  # decorators are signature
            body_start = node.body[0].lineno
            skipped.update(range(first, body_start if body_start > node.lineno else node.lineno + 1))
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0].strip() if not line.strip().startswith(("'", '"')) else line.strip()
        if code and number not in skipped:
            out.append((number, " ".join(code.split())))
    return out


def duplicate_blocks(paths: list[Path], min_lines: int = 8) -> list[list[str]]:
    """Runs of ``min_lines`` logic lines that occur at two or more places (each place as ``file:line``)."""
    seen: dict[tuple[str, ...], list[tuple[Path, int]]] = {}
    for path in paths:
        lines = _logic_lines(path)
        for i in range(len(lines) - min_lines + 1):
            window = tuple(text for _, text in lines[i : i + min_lines])
            places = seen.setdefault(window, [])
            if not places or places[-1][0] != path or lines[i][0] - places[-1][1] >= min_lines:
                places.append((path, lines[i][0]))
    root = PACKAGE.parent
    return [[f"{p.relative_to(root) if p.is_relative_to(root) else p}:{n}" for p, n in places]
            for places in seen.values() if len(places) > 1]


def test_duplicate_check_finds_a_copied_block(tmp_path):
    block = "\n".join(f"    total = total * {i} + value[{i}]" for i in range(8))
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(f"def f(value):\n    total = 0\n{block}\n    return total\n")
    b.write_text(f"def g(value, other):\n    '''another doc'''\n    total = 1  # a comment\n{block}\n    return -total\n")
    assert len(duplicate_blocks([a, b])) == 1


def test_no_logic_is_written_twice():
    """No 8 logic lines appear twice in the package, the scripts or the benchmarks (the check of
    pylint's ``symilar -d 8 -i --ignore-docstrings --ignore-imports --ignore-signatures``, which finds
    none either but takes ~4 minutes on this tree: docs/architecture.md, "One home per concept")."""
    root = PACKAGE.parent
    paths = sorted([*PACKAGE.rglob("*.py"), *(root / "scripts").rglob("*.py"), *(root / "benchmarks").rglob("*.py")])
    assert not duplicate_blocks(paths)


# ---- files and model I/O


def test_checkpoint_files_know_no_model():
    """checkpoint/ is the model-free file format: it imports neither the engine, the MoE layer nor model I/O, and of
    transformers only configs and the weight-conversion machinery (``core_model_loading``), never a model class."""
    allowed = {"transformers": {"PretrainedConfig", "AutoConfig"}, "transformers.core_model_loading": None}
    wrong = []
    for path in sorted((PACKAGE / "checkpoint").rglob("*.py")):
        name = _module_name(path)
        wrong += [f"{name} imports {t}" for t in _imports(path) if t.split(".")[0] in ("engine", "moe", "model_io")]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wrong += [f"{name} imports {a.name}" for a in node.names if a.name.split(".")[0] == "transformers"]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "transformers":
                names = allowed.get(node.module, set())
                wrong += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if names is not None and a.name not in names]
    assert not wrong, wrong



def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore is its module's own: another module that needs it gets a public name (or the
    code moves), so what a module offers the others is what it names publicly."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".") if package else []
                target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("hf_hybrid_ep"):
                target = node.module.removeprefix("hf_hybrid_ep").lstrip(".")
            else:
                continue
            wrong += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {a.name} from {target or 'hf_hybrid_ep'}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__") and target != module]
    assert not wrong, "\n".join(wrong)


def test_model_io_reads_the_engine_through_its_api():
    """Model I/O, inference, the file format and from_pretrained read a parallelized model through the engine's
    read API (``hf_hybrid_ep.engine``: ``config_of``, ``mesh_of``, ``expert_layers``, ``is_parallelized``), never its
    state object."""
    state_names = {"state_of", "carries_state", "HybridEPState", "attach"}
    paths = [*(PACKAGE / "model_io").rglob("*.py"), *(PACKAGE / "inference").rglob("*.py"),
             *(PACKAGE / "checkpoint").rglob("*.py"), PACKAGE / "pretrained.py"]
    wrong = []
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text())):
            used = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else
                    None)
            imported = [a.name for a in node.names] if isinstance(node, ast.ImportFrom | ast.Import) else []
            wrong += [f"{path.relative_to(PACKAGE)}:{node.lineno} {n}" for n in [used, *imported] if n in state_names]
    assert not wrong, wrong

"""The package's layout: subpackages that follow the data, one import order, a small public root.

Imports are read from the source: every ``import`` statement, those inside functions too, and
every ``importlib.import_module("rmsnorm_deploy...")`` string, so neither a lazy import nor a
string hides an edge against the order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rmsnorm_deploy"
NAME = PACKAGE.name
#: the package root keeps only the public surface
MAX_ROOT_MODULES = 10

#: The one package order, lowest first: a module imports only from its own package or an earlier one.
#: Leaf modules first; the root package (the public surface) may import the contract and the graph.
ORDER = (
    ("errors", "optional", "table", "progress", "resources"),
    ("contract",),
    ("graph",),
    ("<root>",),
    ("kernels",),
    ("runners",),
    ("exporter",),
    ("decoder",),
    ("tensorrt",),
    ("validate",),
    ("serving",),
    ("environment",),
    ("commands",),
    ("cli",),
    ("__main__",),
)
RANK = {name: rank for rank, names in enumerate(ORDER) for name in names}
#: The order of the rooms inside ``serving``, lowest first, checked the same way; ``<top>`` is the
#: modules at serving's top (the CLI's glue). Rooms of one rank do not import each other.
SERVING = f"{NAME}.serving"
SERVING_ORDER = (
    ("engine",),
    ("asgi",),
    ("kserve", "openai"),
    ("triton",),
    ("<top>",),
)
SERVING_RANK = {name: rank for rank, names in enumerate(SERVING_ORDER) for name in names}
#: the longest module, in lines, without a reason in its docstring; the longest function
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 100


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports, at its top, inside any function, or by name through
    ``importlib.import_module``."""
    is_package = path.name == "__init__.py"
    here = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` imports pkg.name when that is a module, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith(NAME) and name != module:
                targets.add(name)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module" \
                and node.args:
            text = _literal_prefix(node.args[0])
            if text.startswith(NAME + "."):
                name = text.rstrip(".")
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
    return targets


def _literal_prefix(node: ast.expr) -> str:
    """The constant text at the start of a string or f-string argument (``f"pkg.{x}"`` -> ``pkg.``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return ""


def _package_of(module: str) -> str:
    """The entry of :data:`ORDER` a module belongs to: its subpackage, or its own name at the root."""
    parts = module.split(".")
    if len(parts) == 1:
        return "<root>"
    return parts[1]


def _room_of(module: str) -> str:
    """The entry of :data:`SERVING_ORDER` a module of ``serving`` belongs to."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else "<top>"


def order_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a later package, or inside ``serving`` from a later room or a
    room of the same rank (one line each)."""
    found = []
    for module, targets in sorted(graph.items()):
        here = _package_of(module)
        for target in sorted(targets):
            there = _package_of(target)
            if there == here == "serving":
                found += _room_violation(module, target)
                continue
            if there == here or module.startswith(target + ".") and target == NAME:
                continue
            if RANK[there] > RANK[here]:
                found.append(f"{module} imports {target}: {there} comes after {here} in the package order")
    return found


def _room_violation(module: str, target: str) -> list[str]:
    here, there = _room_of(module), _room_of(target)
    if here == there or target == SERVING:
        return []
    if SERVING_RANK[there] > SERVING_RANK[here]:
        return [f"{module} imports {target}: {there} comes after {here} in serving's order"]
    if SERVING_RANK[there] == SERVING_RANK[here]:
        return [f"{module} imports {target}: {here} and {there} are rooms of one rank in serving's order"]
    return []


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    graph = _import_graph()
    # A package's __init__ is imported before its modules by Python itself: an edge from a module
    # to its own parent package is not an import the code chose, so it does not count.
    for module, targets in graph.items():
        targets -= {p for p in targets if module.startswith(p + ".")}
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    # the finder itself must be able to fail: a known two-module cycle
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from rmsnorm_deploy.exporter import plan\n")
    modules = {"rmsnorm_deploy.exporter.plan": source, "rmsnorm_deploy.exporter": source, "x.m": source}
    assert _imports(source, "x.m", modules) == {"rmsnorm_deploy.exporter.plan"}


#: where an import inside a function is CLI start-up time by rule (commands/__init__ says so)
_START_UP_MODULES = ("rmsnorm_deploy.commands", "rmsnorm_deploy.cli")


def lazy_import_findings(path: Path, module: str) -> list[str]:
    """Imports of project modules inside functions that do not say why (a ``# optional: ...`` or
    ``# start-up: ...`` comment on their line), and any that re-import a module the top imports."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(NAME)):
                continue
            where = f"{module}:{node.lineno} {node.module}"
            if node.module in top:
                found.append(f"{where}: already imported at the top")
            elif not module.startswith(_START_UP_MODULES) and \
                    not re.search(r"#\s*(optional|start-up):", lines[node.end_lineno - 1]):
                found.append(f"{where}: an import inside a function says why (# optional: / # start-up:)")
    return found


def test_an_import_inside_a_function_is_an_optional_dependency_or_start_up_time_and_says_so():
    found = [f for m, p in sorted(_modules().items()) for f in lazy_import_findings(p, m)]
    assert found == []


def test_the_lazy_import_check_fails_on_an_unexplained_one(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from rmsnorm_deploy.errors import UserError\n\ndef f():\n"
                      "    from rmsnorm_deploy.graph import audit\n    from rmsnorm_deploy.errors import UserError\n"
                      "    from rmsnorm_deploy.kernels import triton_rmsnorm  # optional: it imports triton\n")
    assert lazy_import_findings(source, "rmsnorm_deploy.exporter.m") == [
        "rmsnorm_deploy.exporter.m:4 rmsnorm_deploy.graph: an import inside a function says why (# optional: / "
        "# start-up:)",
        "rmsnorm_deploy.exporter.m:5 rmsnorm_deploy.errors: already imported at the top",
    ]


def test_every_package_is_in_the_order():
    packages = {_package_of(m) for m in _modules()}
    assert packages <= set(RANK), sorted(packages - set(RANK))


def test_packages_import_in_one_direction_counting_lazy_imports_and_import_module_strings():
    assert order_violations(_import_graph()) == []


def test_the_order_check_fails_on_a_planted_violation(tmp_path):
    # graph -> runners through an import inside a function, and exporter -> serving through a string
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from rmsnorm_deploy.runners import onnxruntime\n")
    by_name = tmp_path / "by_name.py"
    by_name.write_text("import importlib\ndef f(x):\n    importlib.import_module(f'rmsnorm_deploy.serving.{x}')\n")
    modules = {"rmsnorm_deploy.runners.onnxruntime": lazy, "rmsnorm_deploy.serving": by_name,
               "rmsnorm_deploy.graph.audit": lazy, "rmsnorm_deploy.exporter.plan": by_name}
    graph = {"rmsnorm_deploy.graph.audit": _imports(lazy, "rmsnorm_deploy.graph.audit", modules),
             "rmsnorm_deploy.exporter.plan": _imports(by_name, "rmsnorm_deploy.exporter.plan", modules)}
    assert order_violations(graph) == [
        "rmsnorm_deploy.exporter.plan imports rmsnorm_deploy.serving: serving comes after exporter in the package order",
        "rmsnorm_deploy.graph.audit imports rmsnorm_deploy.runners.onnxruntime: runners comes after graph in the "
        "package order",
    ]


def test_every_room_of_serving_is_in_its_order():
    rooms = {_room_of(m) for m in _modules() if m.startswith(SERVING + ".")}
    assert rooms == set(SERVING_RANK), sorted(rooms ^ set(SERVING_RANK))


def test_the_serving_order_check_fails_on_a_planted_violation():
    graph = {f"{SERVING}.engine.engine": {f"{SERVING}.kserve.generation"},
             f"{SERVING}.openai.app": {f"{SERVING}.kserve.http_front", f"{SERVING}.engine.submit"},
             f"{SERVING}.kserve.front": {f"{SERVING}.server", f"{SERVING}.asgi.body"},
             f"{SERVING}.server": {f"{SERVING}.triton.binding"}}
    assert order_violations(graph) == [
        f"{SERVING}.engine.engine imports {SERVING}.kserve.generation: kserve comes after engine in serving's order",
        f"{SERVING}.kserve.front imports {SERVING}.server: <top> comes after kserve in serving's order",
        f"{SERVING}.openai.app imports {SERVING}.kserve.http_front: openai and kserve are rooms of one rank in "
        "serving's order",
    ]


def _sizes() -> tuple[list[str], list[str]]:
    """Modules over :data:`MAX_MODULE_LINES` whose docstring gives no ``Long: <reason>`` line, and
    functions over :data:`MAX_FUNCTION_LINES` (a kernel may be, if its module says ``Kernel:``)."""
    long_modules, long_functions = [], []
    for module, path in sorted(_modules().items()):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        doc = ast.get_docstring(tree) or ""
        if len(text.splitlines()) > MAX_MODULE_LINES and not re.search(r"^Long: \S", doc, re.M):
            long_modules.append(f"{module} ({len(text.splitlines())} lines)")
        kernel = re.search(r"^Kernel: \S", doc, re.M)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not kernel:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name} ({lines} lines)")
    return long_modules, long_functions


def test_no_module_over_500_lines_without_a_reason_and_no_function_over_100_lines():
    long_modules, long_functions = _sizes()
    assert long_modules == [] and long_functions == []


def test_the_package_root_keeps_the_public_surface_only():
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules


SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
#: described module by module too: the top-level subpackages and serving's rooms
DESCRIBED = SUBPACKAGES + sorted(f"serving/{p.parent.name}" for p in PACKAGE.glob("serving/*/__init__.py"))


@pytest.mark.parametrize("package", DESCRIBED)
def test_each_subpackage_says_what_each_of_its_modules_holds(package):
    init = PACKAGE / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    modules = sorted(p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__")
    modules += sorted(p.parent.name for p in (PACKAGE / package).glob("*/__init__.py"))
    unnamed = [m for m in modules if m.lstrip("_") not in doc]
    assert doc and not unnamed, f"{package}/__init__.py does not describe {unnamed}"


def test_tests_mirror_the_packages():
    tests = Path(__file__).resolve().parent
    missing = [p for p in SUBPACKAGES if not (tests / p).is_dir()]
    assert not missing, f"no tests/<package>/ folder for {missing}"


def test_the_readme_is_a_front_door():
    """At most 300 lines, with the two set-up commands on its first screen (40 lines)."""
    lines = (PACKAGE.parent / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, len(lines)
    first_screen = "\n".join(lines[:40])
    assert "make run" in first_screen and "make test" in first_screen


"""The methods package's structure: no method imports another method, not even through a helper module.

A *method* is a module of ``bdl_bench/methods`` that calls ``register_method``; one in a subpackage
(``laplace/method.py``) makes the whole subpackage that method. Every other module (``base``, ``_shared``,
``_diag_vi``, ``_layerwise_vi``, ...) is a helper, which any method may import. The check follows every import
(top level or inside a function, read with ``ast``) from a method's modules through helpers and fails where it
reaches a different method: what two methods share belongs in a helper.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import bdl_bench.methods
from bdl_bench.methods import METHODS, import_all

PACKAGE = "bdl_bench.methods"


def _package_sources() -> dict[str, str]:
    """Every module of the methods package by its dotted name below it (``"bbb"``, ``"laplace.method"``;
    a subpackage's ``__init__`` by the subpackage's name, the package's own as ``""``)."""
    root = Path(bdl_bench.methods.__file__).parent
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text()
    return sources


def _registered_names(tree: ast.Module) -> list[str]:
    """The names of the ``register_method("name")`` calls in ``tree`` (decorators included)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == "register_method" and node.args and isinstance(node.args[0], ast.Constant):
                names.append(node.args[0].value)
    return names


def _imported(module: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The modules of the package (names in ``modules``) that ``module`` imports anywhere in its code."""
    found = set()
    package = module.split(".")[:-1] if module else []  # what a relative import of level 1 is relative to

    def add(dotted: str) -> None:
        if dotted == PACKAGE or dotted.startswith(PACKAGE + "."):
            name = dotted[len(PACKAGE) + 1 :]
            if name in modules:
                found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([PACKAGE, *package[: len(package) - node.level + 1]])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            add(source)
            for alias in node.names:  # ``from bdl_bench.methods import bbb`` imports the module bbb
                add(f"{source}.{alias.name}")
    found.discard(module)
    return found


def method_imports(sources: Mapping[str, str]) -> list[str]:
    """Each way a method reaches another method's module, as ``"a -> helper -> b"`` (first path found per pair
    of method and reached module), for the package whose modules' sources are ``sources`` (see
    :func:`_package_sources`)."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    registering = {name for name, tree in trees.items() if _registered_names(tree)}
    units = {}  # module -> its method (the top-level name: a subpackage with a method is one method)
    for name in trees:
        top = name.split(".")[0]
        if name in registering or any(m.split(".")[0] == top and "." in m for m in registering):
            units[name] = top
    edges = {name: _imported(name, tree, set(trees)) for name, tree in trees.items()}
    found = []
    for method in sorted(set(units.values())):
        start = [name for name, unit in units.items() if unit == method]
        paths = {name: [name] for name in start}
        queue = list(start)
        while queue:
            name = queue.pop(0)
            for target in sorted(edges[name]):
                if target in paths:
                    continue
                path = [*paths[name], target]
                paths[target] = path
                if units.get(target, method) != method:
                    found.append(" -> ".join([method, *path[1:]] if path[0] == method else [method, *path]))
                else:
                    queue.append(target)
    return found


def test_the_method_modules_found_are_the_registry() -> None:
    """The ``register_method`` calls the check reads name exactly the registered methods."""
    import_all()
    names = [n for source in _package_sources().values() for n in _registered_names(ast.parse(source))]
    assert sorted(names) == sorted(METHODS)


def test_the_check_sees_direct_and_indirect_imports() -> None:
    """A method importing another, directly, lazily inside a function or through a helper, is found; one
    importing helpers only, or its own subpackage's modules, is not."""
    register = "from bdl_bench.methods.base import register_method\n@register_method('{}')\nclass M: ...\n"
    sources = {
        "": "",
        "base": "",
        "_helper": "from bdl_bench.methods.b import thing\n",
        "_clean": "from bdl_bench.methods import base\n",
        "a": register.format("a") + "from bdl_bench.methods._helper import thing\n",
        "b": register.format("b") + "def f():\n    from bdl_bench.methods import c\n",
        "c": register.format("c") + "from bdl_bench.methods._clean import x\nfrom bdl_bench.methods.p import y\n",
        "p": "from bdl_bench.methods.p.method import P\n",
        "p.method": register.format("p") + "from .parts import z\n",
        "p.parts": "from bdl_bench.methods._clean import x\n",
    }
    assert method_imports(sources) == ["a -> _helper -> b", "b -> c", "c -> p"]


def test_no_method_imports_another() -> None:
    """No method reaches another method's module through its imports."""
    assert method_imports(_package_sources()) == []


def test_nothing_imports_the_command_line_entry_point() -> None:
    """``bdl_bench.orchestration.cli`` routes subcommands and imports their modules; none of them imports it back (the
    Hydra application they share is :mod:`bdl_bench.orchestration.hydra_app`), so there is no import cycle through it."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "bdl_bench"
    importers = []
    for path in package.rglob("*.py"):
        if path.name == "cli.py" and path.parent == package / "orchestration":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module in ("bdl_bench", "bdl_bench.orchestration"):
                names += [f"{node.module}.{a.name}" for a in node.names]
            if "bdl_bench.orchestration.cli" in names:
                importers.append(str(path.relative_to(package)))
    assert importers == []

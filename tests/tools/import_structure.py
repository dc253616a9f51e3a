"""The import structure of acshim, read from the source (``ast``; nothing is imported).

Reports three things the design asks to keep at zero (``DESIGN.md``: arrows point down only):

- **circles**: groups of acshim modules that import each other, directly or through others
  (strongly connected components of the import graph). Module-level and function-level imports
  count alike: an import moved into a function to dodge a circle is still a circle. Imports under
  ``if TYPE_CHECKING:`` are left out (they never run).
- **private names crossing modules**: ``from .x import _name`` and ``x._name`` (an attribute of an
  imported acshim module) where the name starts with one underscore and lives in another module.
- **arrows back up**: an import from a lower layer into a higher one. Layers, top down: the CLI and
  its report, ``acshim.patching``, the facades (``acshim.facades``, ``acshim.hf``), the engine (the
  rest of ``acshim``), ``acshim.storage``, ``acshim.backends`` / ``acshim._csrc``. The package root
  ``acshim/__init__.py`` (the public API, importing everything) is left out of the layer check.

Only explicit imports are edges: importing ``acshim.a.b`` also runs ``acshim/a/__init__.py``, but
that implicit parent import is not counted (it would join every module into one circle through the
package root). Usage, from the repository root::

    python tests/tools/import_structure.py            # this tree
    python tests/tools/import_structure.py --root /work/main --json

Prints the counts and each finding; exits 0 (a report, not a check: ``tests/test_import_structure.py``
is the check).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE_FOLDERS = (("acshim", "acshim"), ("acshim.backends", "backends"), ("acshim._csrc", "csrc"))
"""Module prefix and repository folder of each part of the installed package (setup.py's package_dir)."""

LAYERS = (
    ("cli", ("acshim.cli", "acshim.__main__", "acshim.report")),
    ("patching", ("acshim.patching",)),
    ("facades", ("acshim.facades", "acshim.hf")),
    ("storage", ("acshim.storage",)),
    ("backends", ("acshim.backends", "acshim._csrc")),
)
"""Top down; a module in none of them (and not the package root) is in the engine, between
facades and storage."""
LAYER_ORDER = ("cli", "patching", "facades", "engine", "storage", "backends")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    names: tuple[str, ...]
    line: int
    where: str
    """``module`` (runs at import) or ``function`` (runs when the function is called)."""


@dataclass(frozen=True)
class PrivateUse:
    source: str
    target: str
    name: str
    line: int


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the package under ``root``."""
    found = {}
    for prefix, folder in PACKAGE_FOLDERS:
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _resolve(source: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``source``."""
    if level == 0:
        return module or ""
    base = source.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _walk(node: ast.AST, where: str, type_only: bool) -> Iterator[tuple[ast.AST, str, bool]]:
    """Every node with where it runs (module or function level) and whether it is type-only."""
    for child in ast.iter_child_nodes(node):
        child_where = "function" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else where
        child_type_only = type_only or (isinstance(child, ast.If) and _is_type_checking(child.test))
        yield child, child_where, child_type_only
        yield from _walk(child, child_where, child_type_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def scan(root: Path) -> tuple[dict[str, Path], list[Import], list[PrivateUse]]:
    """The package's modules, its imports between acshim modules and its private names used across modules."""
    files = module_files(root)
    imports: list[Import] = []
    private: list[PrivateUse] = []
    for source, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> acshim module it names
        for node, where, type_only in _walk(tree, "module", False):
            if type_only:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "acshim" and alias.name in files:
                        imports.append(Import(source, alias.name, (), node.lineno, where))
                        if alias.asname:
                            bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(source, is_package, node.level, node.module)
                if target.split(".")[0] != "acshim":
                    continue
                from_package: list[str] = []
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in files:  # from . import region: the submodule itself
                        imports.append(Import(source, submodule, (), node.lineno, where))
                        bound[alias.asname or alias.name] = submodule
                    else:
                        from_package.append(alias.name)
                        if _private(alias.name) and target != source:
                            private.append(PrivateUse(source, target, alias.name, node.lineno))
                if from_package and target in files and target != source:
                    imports.append(Import(source, target, tuple(from_package), node.lineno, where))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                target = bound.get(node.value.id)
                if target is not None and target != source:
                    private.append(PrivateUse(source, target, node.attr, node.lineno))
    return files, imports, private


def circles(modules: list[str], imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.target != imp.source:
            edges[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                group.append(item)
                if item == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(modules) + 100))
    for module in sorted(modules):
        if module not in index:
            visit(module)
    return sorted(found)


def layer_of(module: str) -> str | None:
    if module == "acshim":
        return None
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return "engine"


def arrows_up(imports: list[Import]) -> list[Import]:
    """Imports from a lower layer into a higher one."""
    up = []
    for imp in imports:
        source, target = layer_of(imp.source), layer_of(imp.target)
        if source is not None and target is not None and LAYER_ORDER.index(target) < LAYER_ORDER.index(source):
            up.append(imp)
    return up


def report(root: Path) -> dict[str, object]:
    files, imports, private = scan(root)
    found = circles(list(files), imports)
    function_level = [imp for imp in imports if imp.where == "function"]
    return {
        "root": str(root),
        "modules": len(files),
        "imports": len(imports),
        "function_level_imports": len(function_level),
        "circles": found,
        "modules_in_circles": sum(len(c) for c in found),
        "private_names_across_modules": [asdict(p) for p in sorted(set(private), key=lambda p: (p.source, p.line))],
        "arrows_up": [asdict(i) for i in arrows_up(imports)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: here)")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args(argv)
    result = report(args.root)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    circles_found = result["circles"]
    private = result["private_names_across_modules"]
    up = result["arrows_up"]
    print(f"{result['root']}: {result['modules']} modules, {result['imports']} imports between them "
          f"({result['function_level_imports']} inside functions)")
    print(f"circles: {len(circles_found)} ({result['modules_in_circles']} modules)")  # type: ignore[arg-type]
    for group in circles_found:  # type: ignore[union-attr]
        print("  " + " <-> ".join(group))
    print(f"private names imported across modules: {len(private)}")  # type: ignore[arg-type]
    for use in private:  # type: ignore[union-attr]
        print(f"  {use['source']}:{use['line']} uses {use['target']}.{use['name']}")
    print(f"arrows back up the layers: {len(up)}")  # type: ignore[arg-type]
    for imp in up:  # type: ignore[union-attr]
        print(f"  {imp['source']}:{imp['line']} ({layer_of(imp['source'])}, {imp['where']} level) imports "
              f"{imp['target']} ({layer_of(imp['target'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

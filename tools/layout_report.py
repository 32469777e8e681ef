"""The layout's numbers: import cycles between ``cortex`` modules and the longest functions.

``python tools/layout_report.py [ROOT]`` (default: this repository) reads every module of
``libs/``, ``services/``, ``proto/gen`` and ``tools/cortex`` with :mod:`ast` (no import runs)
and prints:

* the import cycles: strongly connected groups of modules that import each other, counting
  every ``import`` / ``from ... import`` of a ``cortex`` module, also inside functions and
  under ``TYPE_CHECKING`` (a cycle there is still a cycle for a reader);
* the functions longer than ``--max-lines`` (default 80) in ``libs/`` and ``services/``,
  longest first, and the longest one;
* the imports of a service's internals from outside it: a module of another distribution
  (the tools, the sim) importing a ``cortex.gateway`` / ``cortex.index`` / ``cortex.ingest``
  module other than the service's public package (its ``__init__``);
* the gateway's modules per subpackage.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOTS = ("libs", "services", "proto/gen", "tools")
SERVICES = ("cortex.gateway", "cortex.index", "cortex.ingest")


def modules(root: Path) -> dict[str, Path]:
    """Every ``cortex.*`` module under the distributions of ``root``, by dotted name."""
    found: dict[str, Path] = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("cortex/**/*.py")):
            if ".venv" in path.parts or "egg-info" in str(path):
                continue
            parts = path.relative_to(root / top).with_suffix("").parts
            start = parts.index("cortex")
            name = ".".join(parts[start:])
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``name`` imports (``from p import m`` counts module ``p.m``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def functions(path: Path) -> Iterator[tuple[int, str]]:
    """``(lines, qualified name)`` of every function of a module."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[int, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield (child.end_lineno or child.lineno) - child.lineno + 1, name
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(tree, "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path("."))
    parser.add_argument("--max-lines", type=int, default=80)
    args = parser.parse_args(argv)
    known = modules(args.root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    groups = cycles(graph)
    print(f"import cycles: {len(groups)}")
    for group in groups:
        print("  " + " <-> ".join(group))
    long: list[tuple[int, str]] = []
    for name, path in known.items():
        if any(part in path.parts for part in ("libs", "services")):
            long += [(n, f"{name}:{f}") for n, f in functions(path)]
    long.sort(reverse=True)
    over = [item for item in long if item[0] > args.max_lines]
    print(f"functions over {args.max_lines} lines in libs/ and services/: {len(over)}"
          f" (longest: {long[0][1]}, {long[0][0]} lines)")
    for n, f in over:
        print(f"  {n:4d} {f}")
    internals = sorted({(name, used) for name, used_all in graph.items() for used in used_all
                        for service in SERVICES
                        if used.startswith(service + ".") and not name.startswith(service)})
    print(f"imports of a service's internals from outside it: {len(internals)}"
          f" in {len({name for name, _ in internals})} modules")
    for name, used in internals:
        print(f"  {name} -> {used}")
    stages = Counter(name.split(".")[2] if name.count(".") > 2 else "(top)"
                     for name, path in known.items()
                     if name.startswith("cortex.gateway.") and path.name != "__init__.py")
    print("gateway modules: " + ", ".join(f"{k} {v}" for k, v in sorted(stages.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

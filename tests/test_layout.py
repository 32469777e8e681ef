"""Tests mirror the code (docs/layout.md): every module of a library, a service or the
simulator has a unit test file named after it (``tests/<part>/**/test_<module>*.py``), or a
row of docs/layout.md's table saying where it is tested instead."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
TREES = ("libs", "services", "tools/sim")


def _expand(name: str) -> list[str]:
    """``kubernetes/{api,config}.py`` → ``kubernetes/api.py``, ``kubernetes/config.py``."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _excused() -> set[tuple[str, str]]:
    """``(part, module path)`` pairs the layout table names, e.g. ``("gateway", "app.py")``."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    excused = set()
    for row in text.splitlines():
        cells = row.split("|")
        if len(cells) < 3 or "`" not in cells[1]:
            continue
        part = cells[1].split()[0]
        for name in re.findall(r"`([^`]+\.py)`", cells[1]):
            excused.update((part, module) for module in _expand(name))
    return excused


def test_every_module_has_its_test_file_or_a_reason() -> None:
    excused = _excused()
    untested = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("cortex/*/**/*.py")):
            if path.name == "__init__.py" or ".egg-info" in str(path):
                continue
            inner = path.parts[path.parts.index("cortex") + 1:]
            part, module = inner[0], "/".join(inner[1:])
            tests = ROOT / "tests" / part
            if any(tests.rglob(f"test_{path.stem}*.py")) or (part, module) in excused:
                continue
            untested.append(f"{part}: {module}")
    assert not untested, ("modules with neither a test file nor a row in docs/layout.md:\n"
                          + "\n".join(untested))


def _layout_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layout_report",
                                                  ROOT / "tools" / "layout_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_and_no_function_over_80_lines() -> None:
    # docs/layout.md's two standing numbers, counted as tools/layout_report.py counts them
    # (imports under TYPE_CHECKING and inside functions included)
    report = _layout_report()
    known = report.modules(ROOT)
    graph = {name: report.imports(name, path, known) for name, path in known.items()}
    assert report.cycles(graph) == []
    long = [(lines, f"{name}:{function}") for name, path in known.items()
            if path.is_relative_to(ROOT / "libs") or path.is_relative_to(ROOT / "services")
            for lines, function in report.functions(path) if lines > 80]
    assert long == []


def test_a_request_passes_through_at_most_20_gateway_modules_and_5_router_entries() -> None:
    # issue 25's bounds on the request path (docs/gateway.md), measured as
    # tools/request_path.py measures them: a regular and a streamed chat request traced
    spec = importlib.util.spec_from_file_location("request_path",
                                                  ROOT / "tools" / "request_path.py")
    assert spec is not None and spec.loader is not None
    request_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(request_path)
    measured = asyncio.run(request_path.measure())
    for kind in ("regular", "streamed"):
        path = measured[kind]
        assert path["gateway_modules"] <= 20, (kind, path["module_list"])
        assert path["router_entries"] <= 5, (kind, path["most_entered"])

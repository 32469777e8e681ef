"""Services import libraries, never each other (architecture §1: the gateway never talks to
ingest and reads the ledger through the index's contract; ingest feeds only the index).

Every import of every module under ``services/<service>/cortex/<service>/`` is read (ast, so
imports inside functions count too) and must stay inside that service or the libraries.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"gateway": "services/gateway/cortex/gateway", "index": "services/index/cortex/index",
            "ingest": "services/ingest/cortex/ingest"}
LIBRARIES = ("cortex.hashing", "cortex.chat", "cortex.ledger", "cortex.registry", "cortex.api",
             "cortex.telemetry", "cortex.edge")


def cortex_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cortex."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("cortex."):
            found.add(node.module)
    return found


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_service_imports_only_itself_and_the_libraries(service: str) -> None:
    own = f"cortex.{service}"
    crossings = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / SERVICES[service]).rglob("*.py"))
        for name in cortex_imports(path)
        if not (name == own or name.startswith(own + ".") or name.startswith(LIBRARIES))
    }
    assert not crossings, "imports across service boundaries:\n" + "\n".join(sorted(crossings))


def test_the_libraries_import_no_service() -> None:
    services = tuple(f"cortex.{s}" for s in SERVICES)
    roots = [ROOT / "libs"]
    crossings = {
        f"{path.relative_to(ROOT)}: {name}"
        for root in roots for path in sorted(root.rglob("*.py"))
        for name in cortex_imports(path) if name.startswith(services)
    }
    assert not crossings, "a library imports a service:\n" + "\n".join(sorted(crossings))

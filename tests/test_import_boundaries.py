"""Each distribution imports only what it declares, and services import libraries, never each
other (architecture §1: the gateway never talks to ingest and reads the ledger through the
index's contract; ingest feeds only the index).

Every import of every module of a distribution's ``cortex/<part>`` trees is read (ast, so
imports inside functions and under ``TYPE_CHECKING`` count too). A ``cortex.*`` import must be
the distribution's own package or one of a ``cortex-*`` distribution it lists in its
``pyproject.toml``; any other import outside the standard library must come from a
distribution it lists (the tools may use their extras too). No service lists another service.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("cortex-gateway", "cortex-index", "cortex-ingest")


def distributions() -> dict[str, Path]:
    """Every distribution's name -> its directory (the ones holding a pyproject.toml)."""
    found = {}
    for pyproject in sorted([*ROOT.glob("*/pyproject.toml"), *ROOT.glob("*/*/pyproject.toml")]):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project")
        if project is not None:
            found[project["name"]] = pyproject.parent
    return found


DISTRIBUTIONS = distributions()


def project(name: str) -> dict[str, object]:
    table = tomllib.loads((DISTRIBUTIONS[name] / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(table["project"])


def declared(name: str, extras: bool) -> set[str]:
    """Canonical names of the distributions ``name`` requires (with every extra's, if asked)."""
    meta = project(name)
    requirements = list(meta.get("dependencies", []))  # type: ignore[call-overload]
    if extras:
        for more in dict(meta.get("optional-dependencies", {})).values():  # type: ignore[call-overload]
            requirements += more
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def packages(name: str) -> set[str]:
    """The ``cortex.<part>`` packages a distribution ships."""
    base = DISTRIBUTIONS[name] / "gen" if name == "cortex-api" else DISTRIBUTIONS[name]
    return {f"cortex.{p.name}" for p in (base / "cortex").iterdir() if (p / "__init__.py").exists()}


def sources(name: str) -> list[Path]:
    base = DISTRIBUTIONS[name] / "gen" if name == "cortex-api" else DISTRIBUTIONS[name]
    return sorted((base / "cortex").rglob("*.py"))


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def owner(module: str) -> str:
    """The ``cortex.<part>`` package of a cortex import."""
    return ".".join(module.split(".")[:2])


NAMES = sorted(DISTRIBUTIONS)


def test_every_library_service_and_the_tools_are_a_distribution() -> None:
    assert {"cortex-api", "cortex-hashing", "cortex-chat", "cortex-ledger", "cortex-telemetry",
            "cortex-edge", "cortex-registry", "cortex-tools", *SERVICES} == set(NAMES)
    shipped = [p for name in NAMES for p in packages(name)]
    assert len(shipped) == len(set(shipped)), "a package shipped by two distributions"


@pytest.mark.parametrize("name", NAMES)
def test_a_distribution_imports_only_itself_and_what_it_declares(name: str) -> None:
    providers = {package: other for other in NAMES for package in packages(other)}
    needs = declared(name, extras=name == "cortex-tools")
    third_party = packages_distributions()
    crossings = set()
    for path in sources(name):
        where = path.relative_to(ROOT)
        for module in imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if top == "cortex":
                provider = providers.get(owner(module))
                if provider is None:
                    crossings.add(f"{where}: {module} (no distribution ships it)")
                elif provider != name and provider not in needs:
                    crossings.add(f"{where}: {module} (from {provider}, not declared)")
                continue
            owners = {canonicalize_name(d) for d in third_party.get(top, [])}
            if not owners & needs:
                crossings.add(f"{where}: {module} (from {sorted(owners) or '?'}, not declared)")
    assert not crossings, "undeclared imports:\n" + "\n".join(sorted(crossings))


@pytest.mark.parametrize("name", NAMES)
def test_no_service_requires_another_service(name: str) -> None:
    if name == "cortex-tools":
        return  # the tools drive every service
    services = set(SERVICES) - {name}
    assert not declared(name, extras=True) & services

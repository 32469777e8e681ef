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
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("cortex-gateway", "cortex-index", "cortex-ingest")


@dataclass(frozen=True)
class Distribution:
    name: str
    project: dict[str, Any]
    root: Path
    """Where its ``cortex/<part>`` tree is."""

    def declared(self, extras: bool) -> set[str]:
        """Canonical names of the distributions it requires (with every extra's, if asked)."""
        requirements = list(self.project.get("dependencies", []))
        if extras:
            for more in self.project.get("optional-dependencies", {}).values():
                requirements += more
        return {canonicalize_name(Requirement(r).name) for r in requirements}

    def packages(self) -> set[str]:
        """The ``cortex.<part>`` packages it ships."""
        return {f"cortex.{p.name}" for p in (self.root / "cortex").iterdir()
                if (p / "__init__.py").exists()}

    def sources(self) -> list[Path]:
        return sorted((self.root / "cortex").rglob("*.py"))


@pytest.fixture(scope="module")
def distributions(install_script: ModuleType) -> dict[str, Distribution]:
    """The repository's distributions, as the images' install script reads them."""
    return {name: Distribution(name, project, install_script.package_root(path))
            for name, (path, project) in install_script.distributions(ROOT).items()}


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


def test_every_library_service_and_the_tools_are_a_distribution(
    distributions: dict[str, Distribution],
) -> None:
    assert {"cortex-api", "cortex-hashing", "cortex-chat", "cortex-kvevents", "cortex-ledger",
            "cortex-telemetry", "cortex-edge", "cortex-registry", "cortex-sim", "cortex-tools",
            *SERVICES} == set(distributions)
    shipped = [p for dist in distributions.values() for p in dist.packages()]
    assert len(shipped) == len(set(shipped)), "a package shipped by two distributions"


def test_a_distribution_imports_only_itself_and_what_it_declares(
    distributions: dict[str, Distribution],
) -> None:
    providers = {package: dist.name for dist in distributions.values()
                 for package in dist.packages()}
    third_party = packages_distributions()
    crossings = set()
    for dist in distributions.values():
        needs = dist.declared(extras=dist.name == "cortex-tools")
        for path in dist.sources():
            where = path.relative_to(ROOT)
            for module in imports(path):
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "__future__":
                    continue
                if top == "cortex":
                    provider = providers.get(owner(module))
                    if provider is None:
                        crossings.add(f"{where}: {module} (no distribution ships it)")
                    elif provider != dist.name and provider not in needs:
                        crossings.add(f"{where}: {module} (from {provider}, not declared)")
                    continue
                owners = {canonicalize_name(d) for d in third_party.get(top, [])}
                if not owners & needs:
                    crossings.add(f"{where}: {module} (from {sorted(owners) or '?'}, "
                                  "not declared)")
    assert not crossings, "undeclared imports:\n" + "\n".join(sorted(crossings))


def test_no_service_requires_another_service(distributions: dict[str, Distribution]) -> None:
    requiring = {dist.name: sorted(dist.declared(extras=True) & (set(SERVICES) - {dist.name}))
                 for dist in distributions.values() if dist.name != "cortex-tools"}
    assert not any(requiring.values()), requiring  # only the tools drive every service


def test_other_distributions_reach_a_service_only_through_its_package(
    distributions: dict[str, Distribution],
) -> None:
    # the tools drive every service, but through what each exports from its __init__ (the
    # stages a benchmark runs included), so a service's modules can move without breaking them
    services = {package for name in SERVICES for package in distributions[name].packages()}
    reaching = set()
    for dist in distributions.values():
        own = dist.packages()
        for path in dist.sources():
            for module in imports(path):
                if owner(module) in services - own and module != owner(module):
                    reaching.add(f"{path.relative_to(ROOT)}: {module}")
    assert not reaching, "imports of a service's internals:\n" + "\n".join(sorted(reaching))

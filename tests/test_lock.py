"""What runs is what was locked: this virtualenv, and every image's requirements, against
``uv.lock`` (docs/contributing.md).

``make test`` already refuses a lock older than a ``pyproject.toml`` (``make lock-check``);
these tests check the other side: nothing installed or shipped drifted from the lock.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = tomllib.loads((REPO / "uv.lock").read_text(encoding="utf-8"))
REQUIREMENTS = REPO / "docker/requirements"


def locked_here() -> dict[str, str]:
    """Third-party name -> the version the lock picks for this interpreter (a package locked
    at several versions, one per Python range, has ``resolution-markers``)."""
    found: dict[str, str] = {}
    for package in LOCK["package"]:
        if "registry" not in package["source"]:
            continue  # the workspace's own distributions
        markers = package.get("resolution-markers")
        if markers is None or any(Marker(m).evaluate() for m in markers):
            found[canonicalize_name(package["name"])] = package["version"]
    return found


def pinned(path: Path) -> dict[str, tuple[str, int]]:
    """An exported requirements file: name -> (version, number of hashes), the entries whose
    markers hold for this interpreter (a package pinned per Python range has one each)."""
    found: dict[str, tuple[str, int]] = {}
    for entry in re.split(r"\n(?=\S)", path.read_text(encoding="utf-8")):
        if not entry.strip() or entry.startswith("#"):
            continue
        requirement = Requirement(entry.split(" \\")[0].split("\n")[0])
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", entry
        found[canonicalize_name(requirement.name)] = (specifier.version,
                                                      entry.count("--hash=sha256:"))
    return found


def runtime_closure(distribution: str) -> set[str]:
    """Every third-party distribution ``distribution`` needs at run time on this interpreter
    (no extras), through the local distributions it requires."""
    pending = [Requirement(r) for r in importlib.metadata.requires(distribution) or []]
    found: set[str] = set()
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found.add(name)
        pending += [Requirement(r) for r in importlib.metadata.requires(name) or []]
    return {name for name in found if not name.startswith("cortex-")}


def test_this_virtualenv_runs_exactly_the_locked_versions() -> None:
    locked = locked_here()
    installed = {canonicalize_name(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions()}
    third_party = {n: v for n, v in installed.items() if not n.startswith("cortex-")}
    assert [n for n in third_party if n not in locked] == [], "installed, but not in uv.lock"
    drifted = {n: (v, locked[n]) for n, v in third_party.items() if locked[n] != v}
    assert drifted == {}, "installed version != locked version"


@pytest.mark.parametrize("image", ["gateway", "index", "ingest", "tools"])
def test_each_image_installs_the_locked_versions_of_all_it_needs(
    image: str, install_script: ModuleType,
) -> None:
    assert image in install_script.IMAGES
    shipped = pinned(REQUIREMENTS / f"{image}.txt")
    locked = locked_here()
    needed = runtime_closure(f"cortex-{image}")
    assert needed - set(shipped) == set(), "needed at run time, missing from the image"
    assert {n: v for n, (v, _) in shipped.items() if n in locked and locked[n] != v} == {}
    assert [n for n, (_, hashes) in shipped.items() if hashes == 0] == [], "pinned without hash"
    # nothing beyond what the distribution needs, save packages for other interpreters
    assert {n for n in set(shipped) - needed if n in locked} == set()


def test_the_images_build_backend_is_the_locked_build_constraint() -> None:
    root = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    constraints = {canonicalize_name(Requirement(c).name): str(Requirement(c).specifier)[2:]
                   for c in root["tool"]["uv"]["build-constraint-dependencies"]}
    shipped = pinned(REQUIREMENTS / "build.txt")
    assert {n: v for n, (v, _) in shipped.items()} == constraints
    assert all(hashes > 0 for _, hashes in shipped.values())


def test_the_dockerfile_and_install_script_take_versions_from_the_lock_only() -> None:
    dockerfile = (REPO / "docker/Dockerfile").read_text(encoding="utf-8")
    assert "COPY docker/requirements docker/requirements" in dockerfile
    assert ("pip install --require-hashes --no-deps -r docker/requirements/build.txt"
            in dockerfile)
    script = (REPO / "docker/install.py").read_text(encoding="utf-8")
    # the only pip install with dependencies reads the image's hashed requirements
    assert '"--require-hashes", "--no-deps", "-r", str(requirements)' in script
    assert '"--no-deps", "--no-build-isolation"' in script

"""Packaging glue: the ``cortex.*`` namespace is spread over several source roots.

Each root (``libs/hashing``, ``services/*``, ``tools``, ``proto/gen``) holds a
``cortex/<part>`` tree; every package found there is mapped to its directory so
editable and regular installs see one ``cortex`` namespace.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOTS = (
    "libs/hashing",
    "libs/chat",
    "libs/ledger",
    "libs/telemetry",
    "libs/edge",
    "libs/registry",
    "services/ingest",
    "services/index",
    "services/gateway",
    "tools",
    "proto/gen",
)

packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for name in find_namespace_packages(root, include=["cortex.*"]):
        path = Path(root, *name.split("."))
        if (path / "__init__.py").exists():
            packages.append(name)
            package_dir[name] = path.as_posix()

setup(packages=packages, package_dir=package_dir)

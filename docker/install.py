"""Install one Cortex image's distribution the way its container does, and check the result.

    python docker/install.py SRC IMAGE [--target DIR] [--no-deps]

IMAGE is ``gateway``, ``index``, ``ingest`` or ``tools`` (docs/layout.md).

1. ``pip install --require-hashes`` the image's third-party requirements, exported from
   ``uv.lock`` into ``docker/requirements/IMAGE.txt`` (``make lock``), so the image runs the
   versions the tests ran; then the image's distribution and the local distributions it requires
   (``cortex-*`` names are resolved from SRC's ``pyproject.toml`` files, never from an index)
   without dependencies or build isolation (the build backend comes pinned from
   ``docker/requirements/build.txt``); then ``opentelemetry-proto`` again where ``xds-protos``
   came along (it ships an older copy of its files, and whichever installs last wins); then
   ``pip check``: nothing any installed distribution requires is missing;
2. imports every command module of the installed distributions and the servers they start,
   from the result alone, and checks that no other service came with it, so a broken or
   bloated install fails the image build.

``--target DIR --no-deps`` installs into a plain directory without dependencies (the test
suite uses it to check the images' installs without a network or a Docker engine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

IMAGES = {"gateway": "services/gateway", "index": "services/index",
          "ingest": "services/ingest", "tools": "tools"}
SERVICES = ("gateway", "index", "ingest")

# what a distribution's commands start beyond their modules (imported lazily by them)
SERVERS = {
    "cortex-gateway": ("cortex.gateway.server", "cortex.gateway.epp.server",
                       "cortex.telemetry.tracing"),
    "cortex-index": ("cortex.index.server",),
    "cortex-ingest": ("cortex.ingest.service",),
    "cortex-registry": ("cortex.registry.kubernetes.service",),
    "cortex-sim": ("cortex.sim.server",),
}


Local = dict[str, tuple[Path, dict[str, object]]]
"""The repository's distributions: name -> (its directory, its ``[project]`` table)."""


def distributions(src: Path) -> Local:
    """Every distribution under ``src`` (each ``pyproject.toml`` with a ``[project]``)."""
    found = {}
    for pyproject in sorted([*src.glob("*/pyproject.toml"), *src.glob("*/*/pyproject.toml")]):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project")
        if project is not None:
            found[project["name"]] = (pyproject.parent, project)
    return found


def package_root(directory: Path) -> Path:
    """Where a distribution keeps its ``cortex/<part>`` tree: its pyproject's
    ``[tool.setuptools.packages.find] where`` (``proto`` keeps it in ``gen``), else itself."""
    table = tomllib.loads((directory / "pyproject.toml").read_text(encoding="utf-8"))
    where = table.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    return directory.joinpath(*where.get("where", ["."])[:1])


def requirement_name(requirement: str) -> str:
    name = requirement.split(";")[0].split("[")[0]
    for stop in "<>=!~ ":
        name = name.split(stop)[0]
    return name.strip()


def closure(local: Local, src: Path, image: str) -> list[str]:
    """The image's distribution and every local distribution it requires, by name."""
    root = next(name for name, (path, _) in local.items() if path == src / IMAGES[image])
    wanted, pending = [], [root]
    while pending:
        name = pending.pop()
        if name in wanted:
            continue
        wanted.append(name)
        requires = local[name][1].get("dependencies", [])
        assert isinstance(requires, list)
        pending += [n for n in map(requirement_name, requires) if n in local]
    return sorted(wanted)


def commands(local: Local, names: list[str]) -> dict[str, str]:
    """The ``cortex`` subcommands the named distributions bring: name -> module."""
    found: dict[str, str] = {}
    for name in names:
        entry_points = local[name][1].get("entry-points", {})
        assert isinstance(entry_points, dict)
        found.update(entry_points.get("cortex.commands", {}))
    return found


def image_commands(src: Path, image: str) -> dict[str, str]:
    """The ``cortex`` subcommands the image offers: name -> module."""
    local = distributions(src)
    return commands(local, closure(local, src, image))


def requirement_block(requirements: str, name: str) -> str:
    """The lines that pin ``name`` (with their hashes) in an exported requirements file."""
    block: list[str] = []
    for line in requirements.splitlines():
        if block and not line.startswith(" "):
            break
        if block or line.startswith(f"{name}=="):
            block.append(line)
    return "\n".join(block) + "\n"


def pip_install(src: Path, local: Local, names: list[str], image: str, target: Path | None,
                no_deps: bool) -> None:
    pip = [sys.executable, "-m", "pip", "install", "--no-cache-dir"]
    requirements = src / "docker/requirements" / f"{image}.txt"
    if not no_deps:
        subprocess.run([*pip, "--require-hashes", "--no-deps", "-r", str(requirements)],
                       check=True, cwd=src)
    command = [*pip, "--no-deps", "--no-build-isolation",
               *(str(local[name][0]) for name in names)]
    if target is not None:
        command += ["--target", str(target)]
    subprocess.run(command, check=True, cwd=src)
    if no_deps:
        return
    pinned = requirement_block(requirements.read_text(encoding="utf-8"), "opentelemetry-proto")
    if "xds-protos==" in requirements.read_text(encoding="utf-8") and pinned.strip():
        subprocess.run([*pip, "--force-reinstall", "--require-hashes", "--no-deps", "-r",
                        "/dev/stdin"], input=pinned, text=True, check=True, cwd=src)
    subprocess.run([sys.executable, "-m", "pip", "check"], check=True, cwd=src)


def check_imports(site: Path, modules: list[str], absent: list[str]) -> None:
    """Import ``modules`` from ``site`` in a fresh interpreter without the source tree
    (``-S``: no .pth files, so an editable install cannot mask a gap), and fail if any of
    ``absent`` can be found there."""
    paths = [str(site)]
    if site != Path(sysconfig.get_path("purelib")):
        paths.append(sysconfig.get_path("purelib"))
    code = (
        "import importlib, importlib.util, sys\n"
        "wanted, absent = sys.argv[1].split(), sys.argv[2].split()\n"
        "for m in wanted: importlib.import_module(m)\n"
        "extra = [m for m in absent if importlib.util.find_spec(m) is not None]\n"
        "sys.exit(f'other services in this image: {extra}' if extra else 0)\n"
    )
    subprocess.run([sys.executable, "-S", "-c", code, " ".join(modules), " ".join(absent)],
                   check=True, cwd="/", env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="the repository (a copy of the build context)")
    parser.add_argument("image", choices=sorted(IMAGES), help="which image's distribution")
    parser.add_argument("--target", type=Path, default=None,
                        help="install into this directory (pip --target)")
    parser.add_argument("--no-deps", action="store_true",
                        help="install the distributions only, none of their dependencies")
    args = parser.parse_args(argv)
    src = args.src.resolve()
    local = distributions(src)
    names = closure(local, src, args.image)
    pip_install(src, local, names, args.image, args.target, args.no_deps)
    site = args.target.resolve() if args.target else Path(sysconfig.get_path("purelib"))
    others = [] if args.image == "tools" else [f"cortex.{s}" for s in SERVICES if s != args.image]
    # every command module, and the servers they start (imported lazily by the commands)
    modules = ["cortex.edge.main", *commands(local, names).values(),
               *(server for name in names for server in SERVERS.get(name, ()))]
    check_imports(site, modules, others)
    print(f"install.py: {', '.join(names)} installed in {site}; every command imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Install Cortex the way the container image does, and check the result.

    python docker/install.py SRC [--target DIR] [--no-deps]

1. ``pip install SRC`` (the project with its runtime dependencies, no dev extra), then
   ``opentelemetry-proto`` again: ``xds-protos`` ships an older copy of its files, and
   whichever installs last wins;
2. imports every service's modules from the result alone, so a broken install fails the
   image build.

``--target DIR --no-deps`` installs into a plain directory without dependencies (the test
suite uses it to check the image's install without a network or a Docker engine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

# what each service command runs (cortex.cli.main dispatches lazily to these)
SERVICE_MODULES = (
    "cortex.cli.main",
    "cortex.cli.up",
    "cortex.index.cli",
    "cortex.index.server",
    "cortex.ingest.cli",
    "cortex.ingest.service",
    "cortex.ingest.cli_workers",
    "cortex.gateway.cli",
    "cortex.gateway.server",
    "cortex.gateway.epp_server",
    "cortex.telemetry.tracing",
    "cortex.sim.cli",
    "cortex.sim.server",
)

def pip_install(src: Path, target: Path | None, no_deps: bool) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-cache-dir", str(src)]
    if no_deps:
        command += ["--no-deps", "--no-build-isolation"]
    if target is not None:
        command += ["--target", str(target)]
    subprocess.run(command, check=True, cwd=src)
    if not no_deps:
        from importlib.metadata import version

        subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir",
                        "--force-reinstall", "--no-deps",
                        f"opentelemetry-proto=={version('opentelemetry-proto')}"],
                       check=True, cwd=src)


def check_imports(site: Path) -> None:
    """Import every service module from ``site`` in a fresh interpreter without the
    source tree (``-S``: no .pth files, so an editable install cannot mask a gap)."""
    paths = [str(site)]
    if site != Path(sysconfig.get_path("purelib")):
        paths.append(sysconfig.get_path("purelib"))
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
    subprocess.run([sys.executable, "-S", "-c", code, *SERVICE_MODULES], check=True,
                   cwd="/", env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="the repository (a copy of the build context)")
    parser.add_argument("--target", type=Path, default=None,
                        help="install into this directory (pip --target)")
    parser.add_argument("--no-deps", action="store_true",
                        help="install the project only, none of its dependencies")
    args = parser.parse_args(argv)
    src = args.src.resolve()
    pip_install(src, args.target, args.no_deps)
    site = args.target.resolve() if args.target else Path(sysconfig.get_path("purelib"))
    check_imports(site)
    print(f"install.py: cortex installed in {site}; every service module imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())

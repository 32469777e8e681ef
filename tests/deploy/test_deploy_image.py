"""The container image's install, rebuilt without a Docker engine.

The build context is assembled from the Dockerfile's own ``COPY`` lines, ``docker/install.py``
(the script the image runs) installs it into a directory without dependencies, and every
service is then started *from that install alone* (``python -S``: no editable install or
source tree on the path), probed with the image's health check script, and stopped.
Packages the image would not have (dev extras and whatever else this virtualenv holds
beyond the runtime requirements and the image's extra ones) are made unimportable in those
processes, so a service that needs one fails here as it would in the container.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cortex.testing import RedisServer, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "docker/Dockerfile").read_text()
COMPOSE_HEALTHCHECK = "/opt/cortex/healthcheck.py"


def load_install_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cortex_image_install",
                                                  REPO / "docker/install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INSTALL = load_install_script()


def source_roots() -> list[Path]:
    """The ``ROOTS`` tuple of ``setup.py``: directories holding a ``cortex/<part>`` tree."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return [REPO / root for root in ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no ROOTS tuple")


def data_files() -> list[Path]:
    """Non-Python files of the ``cortex`` trees (templates, golden vectors, py.typed),
    relative to their source root: the install must have each."""
    return [path.relative_to(root) for root in source_roots()
            for path in sorted((root / "cortex").rglob("*"))
            if path.is_file() and path.suffix not in (".py", ".pyc")
            and "__pycache__" not in path.parts]


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    found: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            found.append([])
        if found:
            found[-1].append(line)
    return found


def context_copies() -> list[tuple[str, str]]:
    """``(source, destination)`` of the build stage's ``COPY`` lines from the context."""
    copies = []
    for line in stages()[0]:
        parts = line.split()
        if parts[0] == "COPY" and not any(p.startswith("--from") for p in parts):
            *sources, dest = parts[1:]
            copies += [(source, dest) for source in sources]
    return copies


def ignored() -> list[str]:
    lines = (REPO / "docker/Dockerfile.dockerignore").read_text().splitlines()
    return [line.strip().removeprefix("**/") for line in lines
            if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's install: context from the COPY lines, then ``docker/install.py``."""
    context = tmp_path_factory.mktemp("context")
    for source, dest in context_copies():
        target = context / dest.rstrip("/") if dest not in ("./", ".") else context
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, target, ignore=shutil.ignore_patterns(*ignored()),
                            dirs_exist_ok=True)
        else:
            target = target / origin.name if dest.endswith("/") else target
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(origin, target)
    installed = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, str(context / "docker/install.py"), str(context), "--target",
         str(installed), "--no-deps"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return installed


def test_the_dockerfile_copies_every_source_root_and_runs_as_a_user() -> None:
    copied = {source.rstrip("/") for source, _ in context_copies()}
    for root in source_roots():
        relative = root.relative_to(REPO).as_posix()
        assert any(relative == c or relative.startswith(c + "/") for c in copied), relative
    assert {"pyproject.toml", "setup.py", "docker/install.py"} <= copied
    final = stages()[-1]
    user = next(line.split()[1] for line in final if line.startswith("USER "))
    assert user.split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["cortex"]' in final
    assert f"COPY docker/healthcheck.py {COMPOSE_HEALTHCHECK}" in final
    assert any("/opt/venv/bin/python docker/install.py /src" in line for line in stages()[0])


def test_the_install_has_the_console_script_and_every_data_file(site: Path) -> None:
    dist = next(site.glob("cortex_gateway-*.dist-info"))
    entry_points = (dist / "entry_points.txt").read_text()
    assert re.search(r"^cortex = cortex\.cli\.main:main$", entry_points, re.MULTILINE)
    missing = [str(relative) for relative in data_files() if not (site / relative).is_file()]
    assert missing == [], f"package data the wheel lacks (pyproject package-data): {missing}"


def runtime_distributions(site: Path) -> set[str]:
    """The built distribution's requirements (no extras), with everything they require
    in turn."""
    dist = importlib.metadata.Distribution.at(next(site.glob("cortex_gateway-*.dist-info")))
    pending = [Requirement(r) for r in dist.requires or []]
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
    return found


def image_site_packages(site: Path, dest: Path) -> Path:
    """``dest`` filled with links to this virtualenv's site-packages entries that belong to
    the image's runtime distributions: what the image's pip install would have put there.
    Modules only other distributions own (dev extras, tools) are left out, so importing
    them fails as it would in the container."""
    allowed = runtime_distributions(site)
    absent = {module for module, owners in importlib.metadata.packages_distributions().items()
              if not {canonicalize_name(o) for o in owners} & allowed}
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        name = entry.name
        if name.endswith((".dist-info", ".egg-info")):
            if canonicalize_name(name.split("-")[0]) not in allowed:
                continue
        elif name.endswith(".pth") or name == "__pycache__" or name.split(".")[0] in absent:
            continue
        (dest / name).symlink_to(entry)
    return dest


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class FromImage:
    """Runs ``cortex`` and the health check script from the image's install only."""

    def __init__(self, site: Path, dependencies: Path, logs: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CORTEX_")}
        # -S: no site-packages and no .pth files; only the install and its dependencies
        self.env = {**env, "PYTHONPATH": os.pathsep.join([str(site), str(dependencies)])}
        self.logs = logs
        self.services: list[Service] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Service:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-S", "-m", "cortex.cli.main", *args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})}, cwd=self.logs)
        service = Service(name, proc, log)
        self.services.append(service)
        return service

    def healthy(self, *args: str) -> bool:
        result = subprocess.run(
            [sys.executable, "-S", str(REPO / "docker/healthcheck.py"), *args],
            env=self.env, capture_output=True, timeout=30, cwd=self.logs)
        return result.returncode == 0

    def wait_healthy(self, service: Service, *args: str) -> None:
        def up() -> bool:
            assert service.proc.poll() is None, f"{service.name} exited:\n{service.text()}"
            return self.healthy(*args)

        wait_until(up, timeout=60, interval=0.2, what=f"{service.name} healthy")

    def stop_all(self) -> None:
        for service in self.services:
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        for service in self.services:
            try:
                service.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()


@pytest.fixture(scope="module")
def image(site: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FromImage]:
    dependencies = image_site_packages(site, tmp_path_factory.mktemp("dependencies"))
    runner = FromImage(site, dependencies, tmp_path_factory.mktemp("logs"))
    try:
        yield runner
    finally:
        runner.stop_all()


@pytest.fixture(scope="module")
def ran(image: FromImage) -> Iterator[list[Service]]:
    """Every service started from the install and found healthy by the image's probe."""
    with RedisServer() as redis:
        index_port = free_port()
        index = image.start("index", "index", "--host", "127.0.0.1", "--port", str(index_port),
                            "--metrics-port", "-1")
        sim_port = free_port()
        sim = image.start("sim", "sim", "--engine", "sglang", "--host", "127.0.0.1",
                          "--port", str(sim_port), "--kv-events-port", "0",
                          "--replay-port", "0", "--zero-cost")
        gateway_port = free_port()
        gateway = image.start("gateway", "gateway", "--host", "127.0.0.1",
                              "--port", str(gateway_port),
                              env={"CORTEX_GATEWAY_MODELS": '[{"name": "cortex-sim"}]'})
        ingest_port = free_port()
        ingest = image.start("ingest", "ingest", "run", "--redis", redis.url, "--index",
                             f"127.0.0.1:{index_port}", "--metrics-host", "127.0.0.1",
                             "--metrics-port", str(ingest_port))
        image.wait_healthy(index, "grpc", f"127.0.0.1:{index_port}")
        image.wait_healthy(sim, "http", f"http://127.0.0.1:{sim_port}/health")
        image.wait_healthy(gateway, "http", f"http://127.0.0.1:{gateway_port}/health/live")
        image.wait_healthy(ingest, "http", f"http://127.0.0.1:{ingest_port}/health/ready")
        image.stop_all()
        yield [index, sim, gateway, ingest]


def test_every_service_runs_from_the_install_and_passes_its_health_check(
    ran: list[Service],
) -> None:
    for service in ran:
        assert service.proc.returncode == 0, f"{service.name}:\n{service.text()[-3000:]}"


def test_dev_only_packages_are_really_absent_there(image: FromImage) -> None:
    def imports(module: str) -> bool:
        probe = subprocess.run([sys.executable, "-S", "-c", f"import {module}"],
                               env=image.env, capture_output=True, timeout=30, cwd=image.logs)
        return probe.returncode == 0

    assert not any(imports(m) for m in ("pytest", "mypy", "matplotlib"))  # dev extra
    # grpcio comes with xds-protos (Envoy's messages, for the endpoint picker): installed,
    # never imported by a service (they speak grpclib)
    assert all(imports(m) for m in ("grpclib", "zmq", "aiohttp", "google.protobuf",
                                    "envoy.service.ext_proc.v3.external_processor_pb2"))
    assert imports("cortex.sim.server") and not imports("cortex.cli.nonexistent")

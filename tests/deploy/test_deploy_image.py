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

# make test-images: ~2 min of pip installs, all in the first test's module fixture (four
# images, each bounded by install()'s own 120 s): the suite's 120 s default would cut it
pytestmark = [pytest.mark.image, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "docker/Dockerfile").read_text()
COMPOSE_HEALTHCHECK = "/opt/cortex/healthcheck.py"


def data_files(install_script: ModuleType, names: list[str]) -> list[Path]:
    """Non-Python files of the named distributions' ``cortex`` trees (templates, golden
    vectors, py.typed), relative to their package root: the install must have each."""
    distributions = install_script.distributions(REPO)
    roots = [install_script.package_root(distributions[name][0]) for name in names]
    return [path.relative_to(root) for root in roots
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


def install(image: str, context: Path, into: Path) -> Path:
    result = subprocess.run(
        [sys.executable, str(context / "docker/install.py"), str(context), image, "--target",
         str(into), "--no-deps"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return into


@pytest.fixture(scope="module")
def sites(install_script: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every image's install: context from the COPY lines, then ``docker/install.py``."""
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
    return {image: install(image, context, tmp_path_factory.mktemp(f"site-{image}"))
            for image in install_script.IMAGES}


def test_the_dockerfile_builds_one_image_per_service_from_its_distribution(
    install_script: ModuleType,
) -> None:
    copied = {source.rstrip("/") for source, _ in context_copies()}
    for path, _ in install_script.distributions(REPO).values():
        relative = path.relative_to(REPO).as_posix()
        assert any(relative == c or relative.startswith(c + "/") for c in copied), relative
    assert "docker/install.py" in copied
    named = {line.split()[-1]: stage for stage in stages() for line in stage[:1]
             if " AS " in line}
    for image in install_script.IMAGES:
        build = named[f"build-{image}"]
        assert f"RUN /opt/venv/bin/python docker/install.py /src {image}" in build
        assert f"COPY --from=build-{image} /opt/venv /opt/venv" in named[image]
        assert named[image][0].startswith("FROM runtime ")
    runtime = named["runtime"]
    user = next(line.split()[1] for line in runtime if line.startswith("USER "))
    assert user.split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["cortex"]' in runtime
    assert f"COPY docker/healthcheck.py {COMPOSE_HEALTHCHECK}" in runtime


def installed(site: Path) -> list[str]:
    return sorted(canonicalize_name(p.name.split("-")[0]) for p in site.glob("*.dist-info"))


def test_each_install_has_the_console_script_and_every_data_file(
    sites: dict[str, Path], install_script: ModuleType,
) -> None:
    for image, site in sites.items():
        edge = next(site.glob("cortex_edge-*.dist-info"))
        entry_points = (edge / "entry_points.txt").read_text()
        assert re.search(r"^cortex = cortex\.edge\.main:main$", entry_points, re.MULTILINE)
        names = installed(site)
        missing = [str(relative) for relative in data_files(install_script, names)
                   if not (site / relative).is_file()]
        assert missing == [], f"{image}: package data the wheel lacks: {missing}"


def test_a_service_image_holds_its_service_and_libraries_only(sites: dict[str, Path]) -> None:
    services = {"gateway", "index", "ingest"}
    for image in services:
        others = {f"cortex-{s}" for s in services - {image}} | {"cortex-tools", "cortex-sim"}
        assert f"cortex-{image}" in installed(sites[image])
        assert not others & set(installed(sites[image])), image
        assert not {s for s in services - {image}
                    if (sites[image] / "cortex" / s).exists()}, image


def runtime_distributions(site: Path, image: str) -> set[str]:
    """The image's distribution's requirements (no extras), with everything they require
    in turn."""
    name = canonicalize_name(f"cortex-{image}").replace("-", "_")
    dist = importlib.metadata.Distribution.at(next(site.glob(f"{name}-*.dist-info")))
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


def image_site_packages(site: Path, image: str, dest: Path) -> Path:
    """``dest`` filled with links to this virtualenv's site-packages entries that belong to
    the image's runtime distributions: what the image's pip install would have put there.
    Modules only other distributions own (dev extras, tools) are left out, so importing
    them fails as it would in the container."""
    allowed = runtime_distributions(site, image)
    absent = {module for module, owners in importlib.metadata.packages_distributions().items()
              if not {canonicalize_name(o) for o in owners} & allowed}
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        name = entry.name
        if name.endswith((".dist-info", ".egg-info")):
            dist = canonicalize_name(name.split("-")[0])
            if dist not in allowed or dist.startswith("cortex-"):  # those are the install's
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
                [sys.executable, "-S", "-m", "cortex.edge.main", *args],
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
def images(sites: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FromImage]]:
    logs = tmp_path_factory.mktemp("logs")
    runners = {
        image: FromImage(site, image_site_packages(
            site, image, tmp_path_factory.mktemp(f"dependencies-{image}")), logs)
        for image, site in sites.items()}
    try:
        yield runners
    finally:
        for runner in runners.values():
            runner.stop_all()


@pytest.fixture(scope="module")
def ran(images: dict[str, FromImage]) -> Iterator[list[tuple[FromImage, Service]]]:
    """Every service started from its own image's install and found healthy by the image's
    probe (the simulated worker from the tools image)."""
    with RedisServer() as redis:
        index_port = free_port()
        index = images["index"].start(
            "index", "index", "--host", "127.0.0.1", "--port", str(index_port),
            "--metrics-port", "-1")
        sim_port = free_port()
        sim = images["tools"].start(
            "sim", "sim", "--engine", "sglang", "--host", "127.0.0.1", "--port", str(sim_port),
            "--kv-events-port", "0", "--replay-port", "0", "--zero-cost")
        gateway_port = free_port()
        gateway = images["gateway"].start(
            "gateway", "gateway", "--host", "127.0.0.1", "--port", str(gateway_port),
            env={"CORTEX_GATEWAY_MODELS": '[{"name": "cortex-sim"}]'})
        ingest_port = free_port()
        ingest = images["ingest"].start(
            "ingest", "ingest", "run", "--redis", redis.url, "--index",
            f"127.0.0.1:{index_port}", "--metrics-host", "127.0.0.1",
            "--metrics-port", str(ingest_port))
        started = [(images["index"], index, ("grpc", f"127.0.0.1:{index_port}")),
                   (images["tools"], sim, ("http", f"http://127.0.0.1:{sim_port}/health")),
                   (images["gateway"], gateway,
                    ("http", f"http://127.0.0.1:{gateway_port}/health/live")),
                   (images["ingest"], ingest,
                    ("http", f"http://127.0.0.1:{ingest_port}/health/ready"))]
        for image, service, probe in started:
            image.wait_healthy(service, *probe)
        for image in images.values():
            image.stop_all()
        yield [(image, service) for image, service, _ in started]


def test_every_service_runs_from_its_image_and_passes_its_health_check(
    ran: list[tuple[FromImage, Service]],
) -> None:
    for _, service in ran:
        assert service.proc.returncode == 0, f"{service.name}:\n{service.text()[-3000:]}"


def test_what_an_image_does_not_need_is_really_absent_there(
    images: dict[str, FromImage],
) -> None:
    def imports(image: str, module: str) -> bool:
        runner = images[image]
        probe = subprocess.run([sys.executable, "-S", "-c", f"import {module}"],
                               env=runner.env, capture_output=True, timeout=30, cwd=runner.logs)
        return probe.returncode == 0

    for image in images:
        assert not any(imports(image, m) for m in ("pytest", "mypy", "matplotlib")), image
    # each service image has what it speaks, not what the others do
    assert all(imports("gateway", m) for m in (
        "grpclib", "aiohttp", "httptools", "tokenizers", "google.protobuf",
        "envoy.service.ext_proc.v3.external_processor_pb2"))
    assert not any(imports("gateway", m) for m in ("zmq", "msgpack", "cortex.index",
                                                    "cortex.ingest", "cortex.sim"))
    assert all(imports("ingest", m) for m in ("zmq", "msgpack", "redis", "cortex.registry",
                                               "cortex.kvevents"))
    assert not any(imports("ingest", m) for m in ("httptools", "tokenizers", "envoy",
                                                   "cortex.gateway", "cortex.index"))
    assert all(imports("index", m) for m in ("grpclib", "numpy", "cortex.ledger"))
    assert not any(imports("index", m) for m in ("zmq", "redis", "httptools", "tokenizers",
                                                  "cortex.gateway", "cortex.registry"))
    assert imports("tools", "cortex.sim.server") and imports("tools", "cortex.devcluster.up")
    assert not imports("tools", "cortex.devcluster.nonexistent")

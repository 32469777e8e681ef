"""docker-compose.yml and its config files agree with the services — checked without Docker.

Every Cortex service's command is parsed by the real ``cortex`` CLI and its environment is
turned into the service's real, validated config (the same loaders the processes use), then
ports, hosts and names are cross-checked: the index the ingest and the gateways dial, the
workers the gateways seed against the sims' own flags, health checks, nginx, Prometheus and
Grafana. What this cannot check (no Docker engine here): that the images build and the
containers start; see docs/operations.md.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from cortex.gateway.config.gateway import GatewayConfig, load_config
from cortex.index.config import IndexConfig
from cortex.ingest.config import IngestConfig
from cortex.registry import WorkerSpec
from cortex.sim.cli import build_config as sim_config
from cortex.sim.config import SimConfig

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "docker/Dockerfile").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
CORTEX = sorted(name for name, svc in SERVICES.items() if "build" in svc)
SIMS = sorted(name for name in CORTEX if SERVICES[name]["command"][0] == "sim")
ParseCortex = Any  # tests/deploy/conftest.py's ParseCortex (a fixture)


def env_of(name: str) -> dict[str, str]:
    """The service's environment as the container sees it (``${VAR:-default}`` → default)."""
    env = SERVICES[name].get("environment", {})
    assert isinstance(env, Mapping), f"{name}: use the mapping form of environment"
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def parse(name: str, parse_cortex: ParseCortex) -> argparse.Namespace:
    """The service's command through the real ``cortex`` parser, with its environment set."""
    return parse_cortex(name, SERVICES[name]["command"], env_of(name))


def exposed(name: str) -> set[int]:
    return {int(p) for p in SERVICES[name].get("expose", [])}


def health_url(name: str) -> str:
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "/opt/cortex/healthcheck.py"], test
    return str(test[4])


@pytest.fixture
def index(parse_cortex: ParseCortex) -> IndexConfig:
    config: IndexConfig = parse_cortex.start(parse("index", parse_cortex))
    assert parse_cortex.unread(env_of("index")) == [], "variables the index never reads"
    return config


@pytest.fixture
def ingest(parse_cortex: ParseCortex) -> IngestConfig:
    config: IngestConfig = parse_cortex.start(parse("ingest", parse_cortex))
    assert parse_cortex.unread(env_of("ingest")) == [], "variables the ingest never reads"
    return config


@pytest.fixture
def gateway(parse_cortex: ParseCortex) -> GatewayConfig:
    parse("gateway", parse_cortex)
    return load_config(None, env_of("gateway"))


@pytest.fixture
def sims(parse_cortex: ParseCortex) -> dict[str, SimConfig]:
    return {name: sim_config(parse(name, parse_cortex)) for name in SIMS}


def test_the_stack_has_every_part_with_its_own_image_and_health_checks() -> None:
    assert {"redis", "index", "ingest", "gateway", "proxy", "prometheus", "grafana"} <= set(
        SERVICES)
    assert {"index", "ingest", "gateway"} <= set(CORTEX) and len(SIMS) >= 2
    builds = {(SERVICES[name]["build"]["context"], SERVICES[name]["build"]["dockerfile"])
              for name in CORTEX}
    assert builds == {(".", "docker/Dockerfile")}
    for name in CORTEX:
        target = SERVICES[name]["build"]["target"]
        assert target == ("tools" if name in SIMS else name), name
        assert SERVICES[name]["image"].startswith(f"cortex-{target}:"), name
        assert f"AS {target}" in DOCKERFILE, f"{name}: docker/Dockerfile has no {target} target"
    for name, svc in SERVICES.items():
        if "ops" not in svc.get("profiles", []):
            assert "healthcheck" in svc, f"{name} has no health check"
    assert SERVICES["prometheus"]["profiles"] == SERVICES["grafana"]["profiles"] == ["ops"]
    # the gateway is reached through the proxy only, so it can be scaled
    assert "ports" not in SERVICES["gateway"] and SERVICES["proxy"]["ports"]


def test_every_cortex_command_is_a_real_subcommand_of_its_image(
    parse_cortex: ParseCortex, image_commands: Callable[[str], frozenset[str]],
) -> None:
    for name in CORTEX:
        args = parse(name, parse_cortex)
        assert callable(args.func), name
        command, image = SERVICES[name]["command"][0], SERVICES[name]["build"]["target"]
        assert command in image_commands(image), f"{name}: the {image} image has no {command}"


def test_index_and_ingest_settings_agree(index: IndexConfig, ingest: IngestConfig) -> None:
    assert index.host == "0.0.0.0" and index.metrics_port is not None
    assert {index.port, index.metrics_port} <= exposed("index")
    assert [(t.host, t.port) for t in ingest.index] == [("index", index.port)]
    redis = urlsplit(ingest.redis_url)
    assert (redis.hostname, redis.port) == ("redis", 6379) and "6379" in SERVICES["redis"][
        "expose"]
    assert ingest.metrics_port is not None and ingest.metrics_port in exposed("ingest")
    assert health_url("ingest") == f"http://127.0.0.1:{ingest.metrics_port}/health/ready"
    test = SERVICES["index"]["healthcheck"]["test"]
    assert test[3:] == ["grpc", f"127.0.0.1:{index.port}"]


def test_gateway_settings_agree_with_index_redis_and_proxy(
    gateway: GatewayConfig, index: IndexConfig,
) -> None:
    assert gateway.index.targets == (f"index:{index.port}",)
    assert gateway.registry.redis_url == "redis://redis:6379/0"
    assert gateway.server.host == "0.0.0.0" and gateway.server.port in exposed("gateway")
    assert gateway.server.admin_token is not None
    assert health_url("gateway") == f"http://127.0.0.1:{gateway.server.port}/health/live"
    nginx = (REPO / "docker/nginx.conf").read_text()
    assert re.search(rf"proxy_pass http://\$gateway_host:{gateway.server.port};", nginx)
    assert re.search(r"set \$gateway_host gateway;", nginx)
    listen = int(re.findall(r"^\s*listen (\d+);", nginx, re.MULTILINE)[0])
    assert any(str(p).endswith(f":{listen}") for p in SERVICES["proxy"]["ports"])
    mount = "./docker/nginx.conf:/etc/nginx/nginx.conf:ro"
    assert mount in SERVICES["proxy"]["volumes"]


def test_seeded_workers_are_the_sims_as_they_run(
    gateway: GatewayConfig, sims: dict[str, SimConfig],
) -> None:
    seeded: dict[str, WorkerSpec] = {w.id: w for w in gateway.workers}
    assert set(seeded) == set(sims)
    models = {m.name: m for m in gateway.models}
    for name, sim in sims.items():
        spec = seeded[name]
        url = urlsplit(spec.url)
        assert (url.hostname, url.port) == (name, sim.port)
        assert sim.host == "0.0.0.0" and sim.advertise_host == name
        assert spec.kv_events == f"tcp://{name}:{sim.kv_events_port}"
        assert spec.replay == f"tcp://{name}:{sim.replay_port}"
        assert {sim.port, sim.kv_events_port, sim.replay_port} <= exposed(name)
        assert health_url(name) == f"http://127.0.0.1:{sim.port}/health"
        model = models[spec.model]
        assert sim.model == spec.model
        assert sim.engine is spec.engine is model.engine
        assert sim.block_size == spec.block_size == model.block_size


def scrape_jobs() -> Iterator[tuple[str, list[str], int]]:
    prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    for job in prometheus["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            yield job["job_name"], list(sd["names"]), int(sd["port"])


def test_prometheus_scrapes_every_service_on_its_metrics_port(
    gateway: GatewayConfig, index: IndexConfig, ingest: IngestConfig,
    sims: dict[str, SimConfig],
) -> None:
    ports = {"gateway": gateway.server.port, "index": index.metrics_port,
             "ingest": ingest.metrics_port, **{name: sim.port for name, sim in sims.items()}}
    scraped: dict[str, int] = {}
    for job, names, port in scrape_jobs():
        assert job.startswith("cortex-")
        for name in names:
            scraped[name] = port
    assert scraped == ports
    prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    mount = "./deploy/prometheus:/etc/prometheus:ro"
    assert mount in SERVICES["prometheus"]["volumes"]
    for rule_file in prometheus["rule_files"]:  # relative to the config: in the same mount
        assert not Path(rule_file).is_absolute()
        assert (REPO / "deploy/prometheus" / rule_file).is_file()


def test_grafana_provisioning_matches_the_mounts() -> None:
    volumes = SERVICES["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    sources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    url = urlsplit(sources["datasources"][0]["url"])
    assert url.hostname == "prometheus" and url.port == 9090
    assert any(str(p).endswith(":9090") for p in SERVICES["prometheus"]["ports"])
    boards = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/cortex.yml").read_text())
    assert boards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "deploy/grafana/dashboards" / Path(home).name).is_file()

"""deploy/kubernetes agrees with the official schemas and with the services — without a cluster.

Every manifest a kustomization lists is validated against the Kubernetes OpenAPI schemas
(``kubernetes-validate``, offline); every Cortex container's arguments go through the real
``cortex`` parser with its environment resolved as the kubelet would (``$(VAR)``, field and
secret references), and become the service's real, validated config. Then names, ports,
probes, token files, shards, Services, the ServiceMonitor and RBAC are cross-checked. What
this cannot check (no API server here): that the cluster accepts and runs them; see
docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from cortex.gateway.config.gateway import GatewayConfig, load_config
from cortex.gateway.errors import ConfigError
from cortex.index.config import IndexConfig
from cortex.ingest.config import IngestConfig
from cortex.ingest.shard import ShardSpec
from cortex.ledger.grpc import read_token
from cortex.registry import WorkerSpec
from cortex.registry.kubernetes import worker_of
from cortex.registry.kubernetes.config import DiscoveryConfig
from cortex.sim.cli import build_config as sim_config

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy/kubernetes"
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())  # pod-index label: 1.28+
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute")}
ParseCortex = Any  # tests/deploy/conftest.py's ParseCortex (a fixture)
POD_IP = "10.1.2.3"


def kustomized(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((directory / name).read_text()) if doc]


DOCS = kustomized(KUBE)
GIE = kustomized(KUBE / "gie")
EXAMPLES = [doc for doc in yaml.safe_load_all((KUBE / "examples/sim-workers.yaml").read_text())
            if doc]


def the(kind: str, name: str, docs: list[dict[str, Any]] = DOCS) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict[str, Any]] = DOCS) -> Iterator[dict[str, Any]]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(only)


def env_of(workload: dict[str, Any], ordinal: int = 0) -> dict[str, str]:
    """The container's environment as the kubelet builds it for pod ``ordinal``."""
    name = workload["metadata"]["name"]
    fields = {"metadata.name": f"{name}-{ordinal}", "metadata.namespace": "cortex",
              "status.podIP": POD_IP,
              "metadata.labels['apps.kubernetes.io/pod-index']": str(ordinal)}
    env: dict[str, str] = {}
    for var in container(workload).get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)",
                                      lambda m: env[m.group(1)], str(var["value"]))
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["secretKeyRef"]
            env[var["name"]] = the("Secret", ref["name"])["stringData"][ref["key"]]
    return env


def args_of(workload: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    spec = container(workload)
    assert "command" not in spec, "the image's entrypoint is `cortex`: set args only"
    return [re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", lambda m: env[m.group(1)], str(a))
            for a in spec["args"]]


def parse(workload: dict[str, Any], parse_cortex: ParseCortex, root: Path,
          ordinal: int = 0, extra: Mapping[str, str] | None = None,
          ) -> tuple[argparse.Namespace, dict[str, str]]:
    """The container's command through the real parser; the files mounted into the
    container are written under ``root`` and the paths that name them point there."""
    env = env_of(workload, ordinal)
    real: dict[str, str] = {}
    for path, (kind, name, key) in mounted(workload).items():
        source = the("Secret" if kind == "secret" else "ConfigMap", name)
        file = root / path.lstrip("/")
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(source["stringData" if kind == "secret" else "data"][key])
        real[path] = str(file)
    env = {k: real.get(v, v) for k, v in env.items()}
    argv = [real.get(a, a) for a in args_of(workload, env)]
    return parse_cortex(workload["metadata"]["name"], argv, {**env, **(extra or {})}), env


def in_container(root: Path, path: str) -> str:
    """The container's own path of a file :func:`parse` wrote under ``root``."""
    return "/" + str(Path(path).relative_to(root))


def mounted(workload: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """Files the container sees: path -> (volume kind, object name, key)."""
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, tuple[str, str, str]] = {}
    for mount in container(workload).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        kind = "secret" if "secret" in volume else "configMap"
        source = volume[kind]
        name = source["secretName"] if kind == "secret" else source["name"]
        if "subPath" in mount:
            files[mount["mountPath"]] = (kind, name, mount["subPath"])
        for item in source.get("items", []):
            files[f"{mount['mountPath']}/{item['path']}"] = (kind, name, item["key"])
    return files


def port_of(workload: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}
    return int(ports[name])


def probe_port(workload: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["port"]
    return port_of(workload, port) if isinstance(port, str) else int(port)


@pytest.fixture
def index(parse_cortex: ParseCortex, tmp_path: Path) -> IndexConfig:
    sts = the("StatefulSet", "cortex-index")
    args, env = parse(sts, parse_cortex, tmp_path)
    config: IndexConfig = parse_cortex.start(args)
    assert parse_cortex.unread(env) == [], "variables the index never reads"
    return config


@pytest.fixture
def gateway(parse_cortex: ParseCortex, tmp_path: Path) -> GatewayConfig:
    deployment = the("Deployment", "cortex-gateway")
    args, _ = parse(deployment, parse_cortex, tmp_path)
    assert mounted(deployment)[in_container(tmp_path, args.config)][0] == "configMap"
    config: GatewayConfig = parse_cortex.start(args)  # unknown CORTEX_GATEWAY_* are errors
    return config


@pytest.fixture
def discovery(parse_cortex: ParseCortex, tmp_path: Path) -> DiscoveryConfig:
    # the kubelet's own variables, beside the container's
    kubelet = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    args, env = parse(the("Deployment", "cortex-discovery"), parse_cortex, tmp_path,
                      extra=kubelet)
    config: DiscoveryConfig = parse_cortex.start(args)
    assert parse_cortex.unread(env) == [], "variables the discovery never reads"
    return config


def ingest_of(parse_cortex: ParseCortex, root: Path, ordinal: int) -> IngestConfig:
    args, env = parse(the("StatefulSet", "cortex-ingest"), parse_cortex, root, ordinal)
    config: IngestConfig = parse_cortex.start(args)
    assert parse_cortex.unread(env) == [], "variables the ingest never reads"
    return config


@pytest.mark.parametrize("directory", ["", "gie"])
def test_a_kustomization_names_every_cortex_image_its_workloads_run(directory: str) -> None:
    listed = yaml.safe_load((KUBE / directory / "kustomization.yaml").read_text())["images"]
    used = {container(w)["image"] for w in workloads(kustomized(KUBE / directory))}
    cortex = {image for image in used if image.startswith("cortex-")}
    assert cortex and cortex == {entry["name"] for entry in listed}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", ["", "monitoring", "gie"])
def test_every_manifest_validates_against_the_official_schemas(directory: str,
                                                               version: str) -> None:
    root = KUBE / directory
    listed = yaml.safe_load((root / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in root.glob("*.yaml")
                                    if p.name != "kustomization.yaml"), "unlisted manifests"
    docs = kustomized(root) + (EXAMPLES if not directory else [])
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # not in the core schemas: checked by hand below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except ValidationError as exc:
            raise AssertionError(f"{where} (Kubernetes {version}): {exc.message} at "
                                 f"{'/'.join(map(str, exc.path))}") from None


def test_every_cortex_container_runs_a_real_command_of_its_image_with_requests_and_limits(
    parse_cortex: ParseCortex, tmp_path: Path, image_commands: Callable[[str], frozenset[str]],
) -> None:
    every = DOCS + EXAMPLES + GIE
    cortex = [w for w in workloads(every) if container(w)["image"].startswith("cortex")]
    assert {w["metadata"]["name"] for w in cortex} == {
        "cortex-index", "cortex-ingest", "cortex-gateway", "cortex-discovery", "cortex-sim",
        "cortex-epp"}
    for workload in cortex:
        args, _ = parse(workload, parse_cortex, tmp_path)
        assert callable(args.func), workload["metadata"]["name"]
        image = container(workload)["image"].split(":")[0].removeprefix("cortex-")
        command = container(workload)["args"][0]
        assert command in image_commands(image), f"the {image} image has no {command}"
    for workload in workloads(every):
        resources = container(workload)["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), workload["metadata"]["name"]
        assert "memory" in resources["limits"], workload["metadata"]["name"]


def test_no_pod_gets_service_links(parse_cortex: ParseCortex, tmp_path: Path) -> None:
    """A Service named cortex-gateway would inject CORTEX_GATEWAY_SERVICE_HOST & co., which
    the gateway's strict loader rejects: every pod template turns service links off."""
    every = DOCS + EXAMPLES + GIE
    templates = {w["metadata"]["name"]: w["spec"]["template"]["spec"] for w in workloads(every)}
    assert len(templates) >= 7
    assert [n for n, pod in templates.items() if pod.get("enableServiceLinks") is not False] == []
    # what such a link looks like to the loader: an error that names the fix
    links = {"CORTEX_GATEWAY_SERVICE_HOST": "10.96.0.7", "CORTEX_GATEWAY_PORT": "tcp://10.96.0.7:80"}
    deployment = the("Deployment", "cortex-gateway")
    args, _ = parse(deployment, parse_cortex, tmp_path, extra=links)
    with pytest.raises(ConfigError, match="enableServiceLinks: false"):
        load_config(None, {**env_of(deployment), **links}, args=args)


def index_names(port: int) -> list[str]:
    sts = the("StatefulSet", "cortex-index")
    service = the("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    return [f"{sts['metadata']['name']}-{n}.{service['metadata']['name']}:{port}"
            for n in range(sts["spec"]["replicas"])]


def test_ingest_and_gateways_dial_every_index_replica_with_its_peer_token(
    index: IndexConfig, gateway: GatewayConfig, parse_cortex: ParseCortex, tmp_path: Path,
) -> None:
    assert index.host == "0.0.0.0" and index.peer_token_file
    names = index_names(index.port)
    assert list(gateway.index.targets) == names
    ingest = ingest_of(parse_cortex, tmp_path, 0)
    assert [f"{t.host}:{t.port}" for t in ingest.index] == names
    secret = the("Secret", "cortex-secrets")["stringData"]
    assert read_token(ingest.index_token_file) == secret["index-peer-token"]
    token_files = {"cortex-index": in_container(tmp_path, index.peer_token_file),
                   "cortex-ingest": in_container(tmp_path, ingest.index_token_file),
                   "cortex-gateway": gateway.index.token_file}
    for name, path in token_files.items():
        workload = next(w for w in workloads() if w["metadata"]["name"] == name)
        assert mounted(workload)[path] == ("secret", "cortex-secrets", "index-peer-token"), name
    sts = the("StatefulSet", "cortex-index")
    for probe in ("readinessProbe", "livenessProbe"):
        assert probe_port(sts, container(sts)[probe]["grpc"]) == index.port
    assert port_of(sts, "metrics") == index.metrics_port


def test_each_ingest_pod_owns_the_shard_of_its_ordinal(parse_cortex: ParseCortex,
                                                   tmp_path: Path) -> None:
    sts = the("StatefulSet", "cortex-ingest")
    count = sts["spec"]["replicas"]
    shards = [ingest_of(parse_cortex, tmp_path, n).shard for n in range(count)]
    assert shards == [ShardSpec(n, count) for n in range(count)]
    config = ingest_of(parse_cortex, tmp_path, 0)
    assert config.metrics_host == "0.0.0.0" and config.metrics_port == port_of(sts, "metrics")
    for probe, path in (("readinessProbe", "/health/ready"), ("livenessProbe", "/health/live")):
        get = container(sts)[probe]["httpGet"]
        assert (get["path"], probe_port(sts, get)) == (path, config.metrics_port)


def redis_address(url: str) -> tuple[str | None, int | None]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def test_everyone_shares_the_one_redis(gateway: GatewayConfig, discovery: DiscoveryConfig,
                                       parse_cortex: ParseCortex, tmp_path: Path) -> None:
    service = the("Service", "cortex-redis")
    expected = (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert gateway.registry.redis_url is not None
    assert redis_address(gateway.registry.redis_url) == expected
    assert redis_address(ingest_of(parse_cortex, tmp_path, 0).redis_url) == expected
    assert redis_address(discovery.redis_url) == expected


def test_gateway_probes_drain_autoscaling_and_disruption_budget(gateway: GatewayConfig) -> None:
    deployment = the("Deployment", "cortex-gateway")
    spec = container(deployment)
    assert gateway.server.host == "0.0.0.0" and port_of(deployment, "http") == gateway.server.port
    assert gateway.server.admin_token == the("Secret", "cortex-secrets")["stringData"][
        "admin-token"]
    for probe, path in (("livenessProbe", "/health/live"), ("readinessProbe", "/health/ready"),
                        ("startupProbe", "/health/live")):
        get = spec[probe]["httpGet"]
        assert (get["path"], probe_port(deployment, get)) == (path, gateway.server.port)
    # the gateway drains itself (not ready, still serving), then stops gracefully: the pod's
    # grace period covers both, and no preStop hook delays the SIGTERM that starts the drain
    assert "lifecycle" not in spec
    assert gateway.server.drain_delay_s >= 5
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= gateway.server.drain_delay_s + gateway.server.graceful_timeout_s + 5
    hpa = the("HorizontalPodAutoscaler", "cortex-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "cortex-gateway"}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert the("PodDisruptionBudget", "cortex-gateway")["spec"]["selector"] == deployment[
        "spec"]["selector"]
    assert gateway.gateway_id == "cortex-gateway-0"  # the pod's name, in logs and metrics


def test_services_select_their_pods_and_name_real_ports() -> None:
    pods = {w["metadata"]["name"]: w for w in workloads()}
    for service in (d for d in DOCS if d["kind"] == "Service"):
        selected = [w for w in pods.values()
                    if service["spec"]["selector"].items()
                    <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            port_of(selected[0], port["targetPort"])  # a named container port
    for workload in pods.values():
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"][
            "template"]["metadata"]["labels"].items()


def test_prometheus_finds_every_metrics_endpoint(
    index: IndexConfig, gateway: GatewayConfig, discovery: DiscoveryConfig,
    parse_cortex: ParseCortex, tmp_path: Path,
) -> None:
    ports = {"cortex-index": index.metrics_port, "cortex-gateway": gateway.server.port,
             "cortex-ingest": ingest_of(parse_cortex, tmp_path, 0).metrics_port,
             "cortex-discovery": discovery.metrics_port}
    for workload in workloads():
        name = workload["metadata"]["name"]
        notes = workload["spec"]["template"]["metadata"].get("annotations", {})
        if name == "cortex-redis":
            continue
        assert notes["prometheus.io/scrape"] == "true", name
        assert (int(notes["prometheus.io/port"]), notes["prometheus.io/path"]) == (
            ports[name], "/metrics"), name
    monitor = the("ServiceMonitor", "cortex", kustomized(KUBE / "monitoring"))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    covered = {
        service["metadata"]["name"] for service in DOCS if service["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items()
        <= service["metadata"]["labels"].items()
        and {p["name"] for p in service["spec"]["ports"]} & scraped
    }
    assert covered == {"cortex-gateway", "cortex-index", "cortex-ingest", "cortex-discovery"}


def test_discovery_reads_only_pods_with_its_own_service_account(
    discovery: DiscoveryConfig,
) -> None:
    deployment = the("Deployment", "cortex-discovery")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    the("ServiceAccount", account)
    role = the("Role", account)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    binding = the("RoleBinding", account)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert discovery.namespace == "cortex" and discovery.api_url == "https://10.96.0.1:443"
    assert discovery.metrics_host == "0.0.0.0"
    assert discovery.metrics_port == port_of(deployment, "metrics")
    for probe, path in (("readinessProbe", "/health/ready"), ("livenessProbe", "/health/live")):
        get = container(deployment)[probe]["httpGet"]
        assert (get["path"], probe_port(deployment, get)) == (path, discovery.metrics_port)


def test_the_example_sim_pods_are_workers_the_gateway_serves(
    gateway: GatewayConfig, discovery: DiscoveryConfig, parse_cortex: ParseCortex, tmp_path: Path,
) -> None:
    deployment = the("Deployment", "cortex-sim", EXAMPLES)
    template = deployment["spec"]["template"]
    selector = discovery.selector  # an existence selector: the label must be there
    assert "=" not in selector and selector in template["metadata"]["labels"]
    args, _ = parse(deployment, parse_cortex, tmp_path)
    sim = sim_config(args)
    pod = {"metadata": {**template["metadata"], "name": "cortex-sim-abc", "namespace": "cortex"},
           "spec": template["spec"],
           "status": {"phase": "Running", "podIP": POD_IP,
                      "conditions": [{"type": "Ready", "status": "True"}]}}
    spec = worker_of(pod, discovery.discovered_by)
    assert isinstance(spec, WorkerSpec), spec
    assert spec.url == f"http://{POD_IP}:{sim.port}" and sim.advertise_host == POD_IP
    assert spec.kv_events == f"tcp://{POD_IP}:{sim.kv_events_port}"
    assert spec.replay == f"tcp://{POD_IP}:{sim.replay_port}"
    assert spec.model == sim.model and spec.engine is sim.engine
    assert spec.block_size == sim.block_size
    served = {m.name: m for m in gateway.models}
    assert served[spec.model].engine is spec.engine
    assert served[spec.model].block_size == spec.block_size
    get = container(deployment)["readinessProbe"]["httpGet"]
    assert (get["path"], probe_port(deployment, get)) == ("/health", sim.port)


def test_the_inference_pool_asks_the_endpoint_picker_about_the_discovered_pods(
    parse_cortex: ParseCortex, tmp_path: Path, discovery: DiscoveryConfig,
) -> None:
    from cortex.gateway.epp.server import SERVICE, PickerHealth

    deployment = the("Deployment", "cortex-epp", GIE)
    args, _ = parse(deployment, parse_cortex, tmp_path)
    parse_cortex.start(args)  # the gateways' own config, and the picker's flags
    assert args.epp_host == "0.0.0.0" and args.epp_port == port_of(deployment, "grpc-epp")
    health = PickerHealth(lambda: True)
    for probe in ("livenessProbe", "readinessProbe"):
        grpc = container(deployment)[probe]["grpc"]
        assert grpc["port"] == args.epp_port and health.status(grpc["service"]) is not None
    assert health.status(SERVICE) is not None
    hpa = the("HorizontalPodAutoscaler", "cortex-epp", GIE)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "cortex-epp"
    assert the("PodDisruptionBudget", "cortex-epp", GIE)["spec"]["selector"] == deployment[
        "spec"]["selector"]
    service = the("Service", "cortex-epp", GIE)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()
    (grpc_port,) = [p for p in service["spec"]["ports"] if p["targetPort"] == "grpc-epp"]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is HTTP/2

    pool = the("InferencePool", "cortex-pool", GIE)
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == (
        "Service", "cortex-epp", grpc_port["port"])
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    sims = the("Deployment", "cortex-sim", EXAMPLES)["spec"]["template"]["metadata"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= sims["labels"].items()
    assert discovery.selector in pool["spec"]["selector"]["matchLabels"]  # the same pods
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        int(sims["annotations"]["cortex/port"])]
    route = the("HTTPRoute", "cortex-inference", GIE)
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": "cortex-pool"}]


def components_allowed(policy: dict[str, Any]) -> dict[int, set[str] | None]:
    """port -> the Cortex components allowed to reach it (``None``: anyone)."""
    allowed: dict[int, set[str] | None] = {}
    for rule in policy["spec"]["ingress"]:
        sources: set[str] | None = None
        for peer in rule.get("from", []):
            selector = peer["podSelector"]
            assert selector["matchLabels"] == {"app.kubernetes.io/name": "cortex"}
            (expression,) = selector["matchExpressions"]
            assert (expression["key"], expression["operator"]) == (
                "app.kubernetes.io/component", "In")
            sources = (sources or set()) | set(expression["values"])
        for port in rule["ports"]:
            allowed[int(port["port"])] = sources
    return allowed


def test_network_policies_let_in_exactly_the_components_that_dial(
    index: IndexConfig,
) -> None:
    components = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for w in workloads(DOCS + GIE)}
    index_policy = components_allowed(the("NetworkPolicy", "cortex-index"))
    assert index_policy == {index.port: {"ingest", "gateway", "epp"},
                            index.metrics_port: None}  # scrapers from anywhere
    redis = the("Service", "cortex-redis")["spec"]["ports"][0]["port"]
    redis_policy = components_allowed(the("NetworkPolicy", "cortex-redis"))
    assert redis_policy == {redis: {"ingest", "gateway", "epp", "discovery"}}
    for name, policy in (("cortex-index", index_policy), ("cortex-redis", redis_policy)):
        selector = the("NetworkPolicy", name)["spec"]["podSelector"]["matchLabels"]
        (target,) = [w for w in workloads() if selector.items()
                     <= w["spec"]["template"]["metadata"]["labels"].items()]
        ports = {p["containerPort"] for p in container(target)["ports"]}
        assert set(policy) <= ports, name
        for allowed in policy.values():
            assert allowed is None or allowed <= components, name

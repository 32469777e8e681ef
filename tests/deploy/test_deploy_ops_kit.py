"""The ops kit (alert rules, Grafana dashboard) only uses metrics the services really export,
and a real Prometheus scraping a loaded cluster fills every panel and fires no alert.

A cluster of real processes serves a few requests; then the gateway's, the index's and the
ingest's ``/metrics`` are scraped, and every ``cortex_*`` name in the alert rules and the
dashboard must be among them. Labels used in selectors and ``by``/``without`` clauses are
checked too wherever the scrape has samples of the metric (a labelled family that never
fired is declared without samples, so its label names are unknown). Every alert also has a
runbook entry in docs/operations.md.

Then Prometheus (Debian's package) scrapes the same cluster every second under a short load
and evaluates the rules; every panel query and every alert go through its HTTP API
(:func:`cortex.bench.opskit.check`; ``cortex bench ops-kit`` is the longer run).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cortex.bench.faults_load import LoadGenerator, LoopThread
from cortex.bench.opskit import KitCheck, check_until_healthy, scrape_targets
from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.testing.prometheus import INSTALL_HINT, PrometheusServer, prometheus_binary

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[2]
ALERTS: dict[str, Any] = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
DASHBOARD: dict[str, Any] = json.loads(
    (REPO / "deploy/grafana/dashboards/cortex.json").read_text())

METRIC = re.compile(r"\b(cortex_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(cortex_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# labels Prometheus itself attaches to every scraped series, and histograms' bucket label
TARGET_LABELS = {"instance", "job", "le"}


def rule_expressions() -> list[str]:
    return [rule["expr"] for group in ALERTS["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"]
            for target in panel.get("targets", [])]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One prefill and one decode worker: the PD panels have data too."""
    spec = ClusterSpec(workers=2, pd=True, gateways=1, port=0, zero_cost=True, lease_ttl_s=3)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def scraped(cluster: LocalCluster) -> str:
    """The gateway's, the index's and the ingest's /metrics after a few requests."""
    system = "The ops kit's assistant. " * 40
    for i in range(3):
        body = json.dumps({"model": cluster.spec.model, "max_tokens": 4, "stream": i == 2,
                           "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": f"question {i}"}]})
        request = urllib.request.Request(
            cluster.gateway_urls[0] + "/v1/chat/completions", data=body.encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
            response.read()
    state = cluster.state()
    return "\n".join([scrape(state["gateways"][0]["metrics_url"]),
                      scrape(state["index"]["metrics_url"]),
                      scrape(state["ingest"]["metrics_url"])])


@pytest.fixture(scope="module")
def prometheus_verdict(cluster: LocalCluster, scraped: str) -> KitCheck:
    """A real Prometheus over the cluster (after ``scraped``, whose counts are exact) under
    a short load: every panel and alert evaluated once each has data, or after 20 s."""
    if prometheus_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(f"prometheus not found on PATH in CI: {INSTALL_HINT}")
        pytest.skip(f"prometheus not found on PATH: {INSTALL_HINT}")
    with PrometheusServer(scrape_targets(cluster.state()),
                          rule_files=[REPO / "deploy/prometheus/alerts.yml"]) as prometheus, \
            LoopThread() as loop:
        load = LoadGenerator(list(cluster.gateway_urls), clients=2, rate=20.0, timeout_s=10.0)
        loop.call(load.start())
        try:
            verdict = check_until_healthy(prometheus, DASHBOARD, "10s", timeout_s=20.0)
        finally:
            loop.call(load.stop())
    assert load.records and all(record.ok for record in load.records), load.records
    return verdict


@pytest.fixture(scope="module")
def exported(scraped: str) -> dict[str, set[str] | None]:
    """Sample name → label names (None: declared, no sample)."""
    return parse_exposition(scraped)


def parse_exposition(text: str) -> dict[str, set[str] | None]:
    """Exposition text → sample name → label names seen (``None``: declared by ``# TYPE``
    only, e.g. a labelled counter that never fired)."""
    names: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            suffixes = {"counter": ("_total", "_created"),
                        "histogram": ("_bucket", "_sum", "_count", "_created"),
                        "summary": ("_sum", "_count", "_created")}.get(kind, ("",))
            base = family.removesuffix("_total") if kind == "counter" else family
            for suffix in suffixes:
                names.setdefault(base + suffix, None)
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = set(re.findall(r'(\w+)="', rest)) if rest else set()
            names[name.split()[0]] = (names.get(name.split()[0]) or set()) | labels
    return names


def test_the_kit_has_rules_and_panels_for_what_operators_watch() -> None:
    alerts = {rule["alert"] for group in ALERTS["groups"] for rule in group["rules"]}
    assert {"CortexLedgerNotReady", "CortexKvEventGaps", "CortexCachePredictionOverClaims",
            "CortexIndexMemoryNearBudget", "CortexUpstreamErrorRate"} <= alerts
    for group in ALERTS["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"]).lower()
    for topic in ("routing decisions by mode", "predicted vs engine-reported", "first byte",
                  "worker load", "ledger states", "event lag", "index memory"):
        assert topic in titles, topic
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"


def test_every_alert_has_a_runbook_entry() -> None:
    operations = (REPO / "docs/operations.md").read_text()
    for group in ALERTS["groups"]:
        for rule in group["rules"]:
            assert f"`{rule['alert']}`" in operations, rule["alert"]


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_and_label_used_is_exported(
    source: str, exported: dict[str, set[str] | None],
) -> None:
    expressions = rule_expressions() if source == "alerts" else dashboard_expressions()
    assert expressions
    missing: set[str] = set()
    for expr in expressions:
        used = set(METRIC.findall(expr))
        missing |= {name for name in used if name not in exported}
        for name, matchers in SELECTOR.findall(expr):
            labels = exported.get(name)
            for label in MATCHER.findall(matchers):
                if labels is not None and label not in labels | TARGET_LABELS:
                    missing.add(f"{name}{{{label}}}")
        known = [exported.get(name) for name in used]
        if any(labels is None for labels in known):
            continue  # some family has no sample: its label names are unknown
        available = set().union(*(labels or set() for labels in known)) | TARGET_LABELS
        for clause in GROUPING.findall(expr):
            for label in (part.strip() for part in clause.split(",") if part.strip()):
                if label not in available:
                    missing.add(f"label {label} in {expr!r}")
    assert not missing, f"not exported by any service: {sorted(missing)}"


def test_the_parser_sees_labelled_families_without_samples() -> None:
    """A labelled counter that never fired is still declared (# TYPE) and so exported."""
    names = parse_exposition('# HELP x_total h\n# TYPE x_total counter\n'
                             '# TYPE h histogram\nh_bucket{le="1"} 0\n')
    assert names["x_total"] is None and names["h_count"] is None
    assert names["h_bucket"] == {"le"}


def test_the_time_to_first_byte_panel_has_data_after_traffic(scraped: str) -> None:
    """Every one of the three requests is observed, per worker and match mode, upstream and
    at the client (its TTFT, streamed or not)."""
    upstream = re.findall(r"^cortex_gateway_upstream_first_byte_seconds_count\{([^}]*)\} (\S+)$",
                          scraped, re.MULTILINE)
    assert sum(float(count) for _, count in upstream) == 3
    for labels, _ in upstream:
        assert re.search(r'worker="(?:prefill|decode)-\d+"', labels) and 'mode="' in labels, labels
    ttft = dict(re.findall(r'^cortex_gateway_ttft_seconds_count\{([^}]*)\} (\S+)$', scraped,
                           re.MULTILINE))
    assert sum(float(v) for k, v in ttft.items() if 'stream="true"' in k) == 1
    assert sum(float(v) for k, v in ttft.items() if 'stream="false"' in k) == 2


def test_every_dashboard_query_has_data_in_prometheus(prometheus_verdict: KitCheck) -> None:
    assert len(prometheus_verdict.panels) == len(dashboard_expressions())
    assert not prometheus_verdict.empty_panels, "\n".join(prometheus_verdict.empty_panels)
    # NaN only where a quantile had no event in the window (the index's Match, which
    # gateways with a synced replica do not call)
    for query in prometheus_verdict.nan_panels:
        assert "histogram_quantile(" in query, query


def test_no_alert_fires_on_the_healthy_cluster(prometheus_verdict: KitCheck) -> None:
    names = {name for name, *_ in prometheus_verdict.alerts}
    assert len(names) == len(rule_expressions())  # Prometheus loaded every rule
    assert not prometheus_verdict.rule_errors
    assert not prometheus_verdict.firing, "\n".join(prometheus_verdict.firing)
    # the ones that watch a quantity present on every cluster do see it
    live = {name for name, _, operand, _ in prometheus_verdict.alerts if operand}
    assert {"CortexLedgerNotReady", "CortexTargetDown", "CortexGatewayNotReady",
            "CortexIndexNotServing", "CortexIngestIndexStreamDown",
            "CortexExactRoutingOff"} <= live, live

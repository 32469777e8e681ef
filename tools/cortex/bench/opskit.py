"""``cortex bench ops-kit``: the alert rules and the Grafana dashboard, evaluated by a real
Prometheus scraping a real cluster under load.

A :class:`~cortex.devcluster.cluster.LocalCluster` (Redis, index, ingest, a gateway, ``--workers``
sims; ``--pd`` makes them prefill/decode pairs) serves :class:`~cortex.bench.faults_load.
LoadGenerator` load (shared system prompts, half streamed) while Prometheus (Debian's
``prometheus``) scrapes every service and every sim each second and evaluates
``deploy/prometheus/alerts.yml``. Then every query of every dashboard panel
(``$__rate_interval`` = ``--rate-window``) and every alert's expression go through the HTTP
API, as Grafana and the rule evaluator send them:

- a panel query must return data: at least one series (Grafana's "No data" is none); a
  quantile of events that did not happen in the window is a series of ``NaN`` (reported);
- an alert must be silent: its expression returns nothing, no rule is pending or firing,
  and every rule evaluated without error. Each alert's operand (the expression without its
  final threshold comparison) is also evaluated and reported: data means the alert watches
  a live quantity; none means its counter has not counted yet (e.g. no error ever).

:func:`check` is the verdict; ``tests/deploy/test_deploy_ops_kit.py`` runs it on a small
cluster, this command on a longer load and writes ``docs/bench/ops-kit.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cortex.bench.faults_load import LoadGenerator, LoopThread
from cortex.bench.report import provenance, table
from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.testing.prometheus import PrometheusServer

__all__ = ["KitCheck", "check", "panel_queries", "register", "scrape_targets",
           "threshold_operand"]

ALERTS = Path("deploy/prometheus/alerts.yml")
DASHBOARD = Path("deploy/grafana/dashboards/cortex.json")
# a comparison with a number closing an alert expression: its threshold
_THRESHOLD = re.compile(r"^(?P<operand>.*?)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.]+(?:e-?\d+)?\s*$",
                        re.DOTALL)


def panel_queries(dashboard: Mapping[str, Any], rate_window: str) -> list[tuple[str, str]]:
    """Every panel's queries as ``(panel title, PromQL)``, Grafana's ``$__rate_interval``
    replaced by ``rate_window``."""
    return [(panel["title"], target["expr"].replace("$__rate_interval", rate_window))
            for panel in dashboard["panels"] for target in panel.get("targets", [])]


def threshold_operand(expr: str) -> str:
    """The expression an alert compares with its threshold (``expr`` itself if none)."""
    match = _THRESHOLD.match(expr.strip())
    return match.group("operand") if match else expr


def scrape_targets(state: Mapping[str, Any]) -> dict[str, list[str]]:
    """``cortex up``'s state (:meth:`LocalCluster.state`) → the job names the rules and the
    dashboard select on → ``host:port`` of each ``/metrics``."""
    def hosts(entries: list[Mapping[str, Any]]) -> list[str]:
        return [urlsplit(str(e["metrics_url"])).netloc for e in entries if e]

    return {"cortex-gateway": hosts(state["gateways"]),
            "cortex-index": hosts([state["index"]]),
            "cortex-ingest": hosts([state["ingest"]]),
            "cortex-workers": hosts(state["workers"])}


@dataclass
class KitCheck:
    """What Prometheus answered for the ops kit at one moment."""

    panels: list[tuple[str, str, int, float | None]] = field(default_factory=list)
    """``(title, query, series, first number or None)`` per panel query."""
    alerts: list[tuple[str, str, int, int]] = field(default_factory=list)
    """``(alert, expression, series of its operand, series of the expression)``."""
    active: list[str] = field(default_factory=list)
    """Alerts pending or firing (``name{labels} state``)."""
    rule_errors: list[str] = field(default_factory=list)

    @property
    def empty_panels(self) -> list[str]:
        """Queries without any series: Grafana shows "No data"."""
        return [f"{title}: {query}" for title, query, series, _ in self.panels if not series]

    @property
    def nan_panels(self) -> list[str]:
        """Queries whose series are all ``NaN`` (a quantile of no event in the window)."""
        return [f"{title}: {query}" for title, query, series, number in self.panels
                if series and number is None]

    @property
    def firing(self) -> list[str]:
        return [f"{name}: {expr}" for name, expr, _, hits in self.alerts if hits] + self.active

    @property
    def healthy(self) -> bool:
        return not (self.empty_panels or self.firing or self.rule_errors)


def _first_number(result: list[dict[str, Any]]) -> float | None:
    """The first sample that is a number (``NaN``, e.g. a quantile of no events, is none)."""
    for element in result:
        value = float(element["value"][1])
        if not math.isnan(value):
            return value
    return None


def check(prometheus: PrometheusServer, dashboard: Mapping[str, Any],
          rate_window: str) -> KitCheck:
    """Evaluate every panel query and every loaded alert rule now."""
    verdict = KitCheck()
    for title, query in panel_queries(dashboard, rate_window):
        result = prometheus.query(query)
        verdict.panels.append((title, query, len(result), _first_number(result)))
    for rule in prometheus.rules():
        if rule.get("type") != "alerting":
            continue
        expr = rule["query"]
        verdict.alerts.append((rule["name"], expr,
                               len(prometheus.query(threshold_operand(expr))),
                               len(prometheus.query(expr))))
        if rule.get("health") not in ("ok", "unknown") or rule.get("lastError"):
            verdict.rule_errors.append(f"{rule['name']}: {rule.get('lastError')}")
    verdict.active = [f"{a['labels'].get('alertname')}{a['labels']} {a['state']}"
                      for a in prometheus.alerts()]
    return verdict


def check_until_healthy(prometheus: PrometheusServer, dashboard: Mapping[str, Any],
                        rate_window: str, timeout_s: float,
                        on_check: Callable[[KitCheck], None] | None = None) -> KitCheck:
    """:func:`check` each second until it is healthy or ``timeout_s`` passes; the last one.

    Panels fill in as scrapes accumulate (a ``rate`` needs two samples in its window)."""
    deadline = time.monotonic() + timeout_s
    while True:
        verdict = check(prometheus, dashboard, rate_window)
        if on_check is not None:
            on_check(verdict)
        if verdict.healthy or time.monotonic() >= deadline:
            return verdict
        time.sleep(1.0)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "ops-kit", help="alert rules and dashboard queries through a real Prometheus")
    parser.add_argument("--workers", type=int, default=4, help="simulated workers")
    parser.add_argument("--pd", action="store_true",
                        help="the workers form prefill/decode pairs (the PD panels)")
    parser.add_argument("--seconds", type=float, default=40.0, help="load before the check")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--rate-window", default="15s",
                        help="$__rate_interval (Grafana: 4 scrape intervals at least)")
    parser.add_argument("--deploy", type=Path, default=Path("."),
                        help="the repository (deploy/ is read from it)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/ops-kit.md"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    dashboard = json.loads((args.deploy / DASHBOARD).read_text())
    spec = ClusterSpec(workers=args.workers, pd=args.pd, gateways=1, port=0,
                       sim_args=("--prefill-ms-per-token", "0.02", "--decode-ms-per-token",
                                 "2"), lease_ttl_s=5)
    made = provenance()
    with tempfile.TemporaryDirectory(prefix="cortex-ops-kit-") as logs, \
            LocalCluster(spec, logs) as cluster, \
            PrometheusServer(scrape_targets(cluster.state()),
                             rule_files=[args.deploy / ALERTS]) as prometheus, \
            LoopThread() as loop:
        load = LoadGenerator(list(cluster.gateway_urls), clients=4, rate=args.rate)
        loop.call(load.start())
        try:
            time.sleep(args.seconds)  # the load runs for this long: a measured duration
            verdict = check_until_healthy(prometheus, dashboard, args.rate_window, 30.0)
        finally:
            loop.call(load.stop())
        cluster.check()
    records = load.records
    failed = [r for r in records if not r.ok]
    _report(args, made, verdict, len(records), failed)
    return 0 if verdict.healthy and not failed else 1


def _report(args: argparse.Namespace, made: dict[str, str], verdict: KitCheck,
            requests: int, failed: list[Any]) -> None:
    mode = "prefill/decode pairs" if args.pd else "regular workers"
    lines = [
        "# The ops kit through a real Prometheus",
        "",
        f"Generated {made['generated']} at commit `{made['commit']}` on {made['machine']}: "
        f"`cortex bench ops-kit --workers {args.workers}{' --pd' if args.pd else ''} "
        f"--seconds {args.seconds:g} --rate {args.rate:g} --rate-window {args.rate_window}`. "
        f"A local cluster ({args.workers} sims as {mode}, one gateway) served {requests} "
        f"chat completions ({len(failed)} failed) while Prometheus "
        "(Debian's package) scraped gateway, index, ingest and sims every second and "
        "evaluated `deploy/prometheus/alerts.yml`; then every dashboard query and every alert "
        "went through its HTTP API.",
        "",
        f"**Verdict: {'healthy' if verdict.healthy else 'NOT healthy'}** — "
        f"{len(verdict.empty_panels)} of {len(verdict.panels)} panel queries without data, "
        f"{len(verdict.firing)} alerts firing or pending, {len(verdict.rule_errors)} rule "
        "errors.",
        "",
        "## Dashboard panels",
        "",
        *table(["panel", "query", "series", "a value"],
               [[title, f"`{query}`", series,
                 "**no data**" if not series else "NaN" if value is None else f"{value:.4g}"]
                for title, query, series, value in verdict.panels], "llrr"),
        "",
        "NaN: a quantile of events that did not happen in the window (the panel draws "
        "nothing for that series; its other queries say why).",
        "",
        "## Alerts (healthy cluster: all silent)",
        "",
        "The operand is the expression without its threshold: its series are what the alert "
        "watches (0: the counter it divides has not counted anything, e.g. no error yet).",
        "",
        *table(["alert", "operand series", "firing series"],
               [[name, operand, hits] for name, _, operand, hits in verdict.alerts], "lrr"),
    ]
    for title, items in (("Empty panels", verdict.empty_panels), ("Firing", verdict.firing),
                         ("Rule errors", verdict.rule_errors)):
        if items:
            lines += ["", f"## {title}", "", *(f"- `{item}`" for item in items)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines), file=sys.stderr)

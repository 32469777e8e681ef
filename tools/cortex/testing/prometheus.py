"""A private, real Prometheus (Debian's ``prometheus`` package) scraping given targets.

```python
with PrometheusServer({"cortex-gateway": ["127.0.0.1:8080"]}, rule_files=[alerts]) as prom:
    prom.query('up{job="cortex-gateway"}')   # the result vector: [{"metric": ..., "value": ...}]
    prom.alerts()                            # pending and firing alerts
```

It binds 127.0.0.1 on a free port, keeps its TSDB in a temporary directory and scrapes and
evaluates its rules every ``interval_s`` (1 s: a short load run gives ``rate()`` windows
enough samples). Queries go through the HTTP API exactly as Grafana's do.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cortex.testing.procs import ProgramProcess, free_port

__all__ = ["PrometheusError", "PrometheusServer", "prometheus_binary"]

INSTALL_HINT = "install Debian's prometheus package (apt-get install prometheus; .ci/run does)"


class PrometheusError(RuntimeError):
    """Prometheus refused a query (bad PromQL) or did not start; the message has its words."""


def prometheus_binary(name: str = "prometheus") -> str | None:
    """The path of ``prometheus`` (or ``promtool``), ``None`` when not installed."""
    return shutil.which(name)


class PrometheusServer(ProgramProcess):
    """Starts ``prometheus`` with ``targets`` (job name → ``host:port`` list, ``/metrics``)
    and ``rule_files``; ``url`` is ready once ``__enter__`` returns."""

    def __init__(self, targets: Mapping[str, Sequence[str]],
                 rule_files: Sequence[Path] = (), interval_s: float = 1.0) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError(f"prometheus not found on PATH: {INSTALL_HINT}")
        super().__init__("prometheus")
        self.binary = binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = {job: list(hosts) for job, hosts in targets.items()}
        self.rule_files = [Path(f).resolve() for f in rule_files]
        self.interval_s = interval_s

    def config(self) -> dict[str, Any]:
        """The configuration it runs with (``prometheus.yml``'s content)."""
        interval = f"{int(self.interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": interval},
            "rule_files": [str(f) for f in self.rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in self.targets.items()],
        }

    def start(self, timeout: float = 30.0) -> None:
        config = self.work_dir / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=2))  # JSON is YAML
        self._launch([self.binary, f"--config.file={config}",
                      f"--storage.tsdb.path={self.work_dir}/data",
                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                     self.url + "/-/ready", timeout, error=PrometheusError)

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; :class:`PrometheusError` on an error answer."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}",
                                        timeout=10) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 400/422: a bad expression, with its reason
            answer = json.loads(exc.read() or b"{}")
        if answer.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {answer.get('errorType')}: "
                                  f"{answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: the vector's elements (``metric``, ``value``)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert pending or firing now."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its last evaluation (``health``, ``lastError``)."""
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"PrometheusServer({self.url}, jobs={list(self.targets)}, {state})"

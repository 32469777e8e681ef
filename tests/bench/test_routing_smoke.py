"""``cortex bench routing --quick`` end to end: every contender, every workload, all counted.

Starts real processes (Redis, index, ingest, gateways, sims, sglang-router, vllm-router,
HAProxy); asserts that the run is complete and verified, never how fast anything was (that
is the report's job).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cortex.bench.routing.balancer import haproxy_binary
from cortex.bench.routing.command import QUICK_VARIANT_CONTENDERS, QUICK_WORKLOADS
from cortex.bench.routing.contenders import CONTENDERS, OPT_IN, VARIANT_ONLY
from cortex.bench.routing.scenarios import VARIANTS

pytestmark = [pytest.mark.slow, pytest.mark.bench]

TRACES = Path(__file__).parent / "data" / "traces"
"""The first 30 s of each Mooncake trace (what ``--quick`` replays), so a clone runs it alone."""


@pytest.mark.timeout(180)
def test_quick_mode_sends_verifies_and_reports_everything(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "cortex.edge.main", "bench", "routing", "--quick", "--out",
         str(out), "--traces", str(TRACES)],
        capture_output=True, text=True, timeout=170, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "report.json").read_text())
    runs = {(r["workload"], r["contender"]): r for r in doc["runs"]}
    balancer = haproxy_binary() is not None
    assert set(runs) == {(w, c) for w in QUICK_WORKLOADS
                         for c in (QUICK_VARIANT_CONTENDERS if w in VARIANTS else
                                   [c for c in CONTENDERS
                                    if c not in VARIANT_ONLY and c not in OPT_IN])
                         if balancer or w not in VARIANTS or not VARIANTS[w].replicas}
    repeats = doc["config"]["repeats"]
    for (workload, _), run in runs.items():
        expected = doc["workloads"][workload]["requests"] * repeats
        assert run["requests_sent"] == run["requests_ok"] == expected > 0
        assert run["verified"] and run["prompt_token_mismatches"] == 0
        assert 0 <= run["hit_rate"] <= doc["bounds"][workload] + 0.01
        assert run["ttft_p50_ms"] > 0 and run["throughput_rps"] > 0
    for workload in QUICK_WORKLOADS:
        if (workload, "cortex") not in runs:
            assert "haproxy" in doc["variants"][workload]["skipped"]["cortex"]
            continue
        assert runs[(workload, "cortex")]["prediction"]["requests"] == \
            doc["workloads"][workload]["requests"] * repeats
        assert runs[(workload, "sglang_cache_aware")]["prediction"] is None
    events = runs[("churn", "cortex")]["churn"]
    assert [e["action"] for e in events] == ["restart", "flush"]
    assert all(e["at_s"] is not None and e["requests"] > 0 for e in events)
    for contender in QUICK_VARIANT_CONTENDERS:
        assert runs[("churn", contender)]["stale"]["requests"] == \
            doc["workloads"]["churn"]["requests"]
        assert runs[("pd", contender)]["decode_pool"]
    report = (out / "report.md").read_text()
    assert "## Targets" in report and "sglang_cache_aware" in report
    for plot in ("hit_rate.png", "ttft.png", "ttft_cdf.png", "ladder.png",
                 *(("replicas.png",) if balancer else ())):
        assert (out / plot).stat().st_size > 1000

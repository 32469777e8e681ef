"""``cortex bench faults --quick`` end to end, and its bookkeeping (pure).

The smoke run starts real processes (Redis, index, ingest, 2 gateways, 3 sims) and injects
the quick faults; it asserts the run is complete and counted, never how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cortex.bench.faults import FAULTS, _exact_recovery, render
from cortex.bench.faults_catalogue import QUICK
from cortex.bench.faults_load import Record


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(150)
def test_quick_mode_injects_every_quick_fault_and_reports_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cortex.edge.main", "bench", "faults", "--quick", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "faults.json").read_text())
    assert report["canary_warmed"] and report["baseline"]["requests"] > 0
    faults = {f["name"]: f for f in report["faults"]}
    assert set(faults) == set(QUICK)
    for fault in faults.values():
        assert fault["requests"] > 0 and fault["canary_probes"] > 0, fault
        assert fault["errors"] == [], fault
        assert fault["restore"].startswith("ready") or "re-registered" in fault["restore"]
    garbage = faults["event_garbage"]["notes"]
    assert garbage["garbage sent (MiB)"] > 40  # the oversize message and the flood went out
    assert garbage["real ledgers READY"] is True
    assert "worker in the pool after the fault" in faults["worker_500"]["notes"]
    text = (tmp_path / "faults.md").read_text()
    for fault in faults.values():
        assert f"| {fault['title']} |" in text


def probe(at: float, exact: bool) -> Record:
    return Record(started=at, duration_s=0.05, ok=True, mode="exact_kv" if exact else "",
                  hit_tokens=100 if exact else 0)


def test_exact_recovery_is_measured_from_the_last_miss() -> None:
    never = [probe(t, True) for t in (0.0, 0.25, 0.5)]
    assert _exact_recovery(never, 0.0) == (0.0, 0.0)
    lost = [probe(0.0, True), probe(0.25, False), probe(0.5, True), probe(0.75, False),
            probe(1.0, True), probe(1.25, True)]
    assert _exact_recovery(lost, -0.5) == (1.5, 0.5)  # back at 1.0, 0.5 s lost in all
    not_back = [probe(0.0, True), probe(0.25, False)]
    assert _exact_recovery(not_back, 0.0)[0] is None


def test_every_fault_has_a_unique_name_and_the_quick_ones_exist() -> None:
    names = [f.name for f in FAULTS]
    assert len(names) == len(set(names)) == 26
    assert set(QUICK) <= set(names)


def test_the_report_marks_failures_and_missing_recovery() -> None:
    plan = {"quick": True, "hold_s": 2, "hang_hold_s": 4, "observe_s": 8, "hung_s": 3,
            "timeout_s": 8, "clients": 2, "rate": 4}
    fault = {"name": "kill_index", "title": "kill -9 of the index", "requests": 10,
             "failed": 3, "failures": {"http 503": 3}, "hung": 1, "slowest_s": 4.2,
             "p50_s": 0.05, "failovers": 0, "canary_probes": 20, "exact_back_s": None,
             "exact_lost_s": 3.0, "notes": {"x": 1}, "errors": [], "restore": "ready in 1 s"}
    text = render({"plan": plan, "generated": "now", "commit": "abc", "machine": "m",
                   "duration_s": 10, "cluster": "c", "baseline": {"requests": 1, "failed": 0,
                                                                  "exact": 1},
                   "faults": [fault]})
    assert "| kill -9 of the index | 10 | **3** | **1** | 4.2 s | **not back** | x: 1 |" in text
    assert "http 503 x 3" in text

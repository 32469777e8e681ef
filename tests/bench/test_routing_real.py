"""The pure parts of ``cortex bench routing --real-engines``: the row a contender's shots
make, the seeded conversations, and the report built from the rows of separate runs."""

from __future__ import annotations

import json
from pathlib import Path

from cortex.bench.routing.real import Conversations, Shot, summarise, write_report

CPU = {"wall_s": 10.0, "processes": {"gateway-0": 0.3, "index": 0.1, "load generator": 5.0}}


def test_a_row_counts_the_engines_hits_and_cortex_predictions() -> None:
    shots = [Shot(0.05, 100, 0, 0), Shot(0.03, 200, 160, 176), Shot(0.01, 100, 96, 96),
             Shot(0.02, 100, 96, 96)]
    row = summarise("cortex", shots, CPU)
    assert row["hit_rate"] == round(352 / 500, 4)
    assert (row["over_predictions"], row["exact"]) == (1, 3)
    assert (row["ttft_p50_ms"], row["ttft_p90_ms"]) == (30.0, 50.0)
    # per request, routing tier only: the load generator is not charged
    assert row["cpu_ms_per_request"] == {"gateway-0": 75.0, "index": 25.0}
    assert row["routing_cpu_ms_per_request"] == 100.0
    peer = summarise("round_robin", [Shot(0.01, 100, 0, -1)], CPU)
    assert (peer["over_predictions"], peer["exact"]) == (None, None)  # nothing predicted


def test_conversations_grow_and_restart_near_their_limit() -> None:
    chats = Conversations(2, seed=7, max_tokens=50)
    i, messages = chats.next()
    assert [m["role"] for m in messages] == ["system", "user"]
    chats.answered(i, messages, "answer", size=10)
    assert Conversations(2, seed=7).chats == Conversations(2, seed=7).chats  # seeded
    while (n := chats.next())[0] != i:
        pass
    assert [m["role"] for m in n[1]] == ["system", "user", "assistant", "user"]
    chats.answered(i, n[1], "again", size=60)  # past the limit: a fresh opening next time
    while (n := chats.next())[0] != i:
        pass
    assert [m["role"] for m in n[1]] == ["system", "user"]


def test_the_report_joins_runs_in_contender_order(tmp_path: Path) -> None:
    for name in ("round_robin", "cortex"):
        row = summarise(name, [Shot(0.02, 100, 50, 50 if name == "cortex" else -1)], CPU)
        (tmp_path / f"real-{name}.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| cortex")
            or line.startswith("| round_robin")]
    assert [r.split(" | ")[0] for r in rows] == ["| cortex", "| round_robin"]
    assert "| 0 (1 of 1) |" in rows[0] and "| — |" in rows[1]
    assert (tmp_path / "real-engines.png").stat().st_size > 0


def test_a_profiled_row_adds_its_top_frames_to_the_report(tmp_path: Path) -> None:
    row = summarise("cortex", [Shot(0.02, 100, 50, 50)], CPU)
    row["profile"] = {"process": "gateway-0", "samples": 1234, "frames": [
        {"name": "route (gateway/routing/router)", "self_pct": 12.5, "total_pct": 40.0}]}
    (tmp_path / "real-cortex.json").write_text(json.dumps(row))
    text = write_report(tmp_path, "cortex bench routing --real-engines --profile").read_text()
    assert "## Where cortex's gateway-0 spends its time (py-spy)" in text
    assert "1,234 samples" in text
    assert "| `route (gateway/routing/router)` | 12.5 | 40.0 |" in text

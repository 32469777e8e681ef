"""The report's variant sections and targets, from hand-made results (no processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cortex.bench.routing.metrics import Outcome, RunSummary, summarize
from cortex.bench.routing.report import report_json, report_markdown, write_plots
from cortex.bench.routing.results import WorkloadResult
from cortex.bench.routing.workloads import Endpoint, Request, Workload

N = 4


def _run(name: str, contender: str, cached: int, predicted: int | None = None,
         **extra: Any) -> RunSummary:
    outs = []
    for i in range(N):
        o = Outcome(i, f"d{i}", i * 0.1, i * 0.1)
        o.ttft_s, o.done_s = 0.01, i * 0.1 + 0.2
        o.prompt_tokens, o.cached_tokens, o.completion_tokens = 100, cached, 4
        o.predicted_hit_tokens = predicted
        outs.append(o)
    return summarize(name, contender, outs, [f"d{i}" for i in range(N)], [100] * N, [4] * N,
                     extra=extra)


def _result(name: str, runs: dict[str, RunSummary]) -> WorkloadResult:
    w = Workload(name, f"title of {name}", "src",
                 tuple(Request(i, Endpoint.COMPLETIONS, 4, 0.0, prompt="x") for i in range(N)))
    res = WorkloadResult(w, 400, infinite_bound=0.8, pooled_bound=0.8, unique_pages=100,
                         capacity_blocks=10, offered_prefill_load=0.5)
    res.runs.update(runs)
    res.ttfts_ms = {c: [10.0] * N for c in runs}
    return res


def _event(action: str, late: int) -> dict[str, Any]:
    window = {"requests": 3, "hit_rate": 0.5, "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0,
              "worker_requests": 1, "worker_hit_rate": 0.0, "over_predictions": late}
    return {"action": action, "worker": "worker-0", "planned_s": 1.0, "attempts": 2,
            "at_s": 1.2, "window_s": 3.0, **window, "before": window,
            "over_predictions_after_allowance": late}


def _config() -> dict[str, Any]:
    return {"command": "cortex bench routing", "date": "d", "duration_min": 1.0, "machine": "m",
            "workers": 2, "block_size": 16, "prefill_ms_per_token": 0.2,
            "prefill_overhead_ms": 2.0, "decode_ms_per_token": 5.0, "repeats": 1,
            "quiet_wait_s": 0, "max_foreign_cores": None, "cortex_weights_note": "",
            "profile": {"tokens_per_block": 32, "capacity_fraction": 0.3}}


def test_variant_targets_sections_and_plot(tmp_path: Path) -> None:
    results = [
        _result("shared_prefix_r1", {"cortex": _run("a", "cortex", 80, 80),
                                     "sglang_cache_aware": _run("a", "sglang_cache_aware", 80)}),
        _result("shared_prefix_r4", {"cortex": _run("b", "cortex", 79, 79),
                                     "sglang_cache_aware": _run("b", "sglang_cache_aware", 50)}),
        _result("churn", {"cortex": _run("c", "cortex", 60, 60, churn=[
            _event("restart", 0), _event("flush", 2)], stale={"requests": 4, "affine": 2,
                                                              "stale": 1, "stale_tokens": 16})}),
        _result("kv_pressure", {"sglang_round_robin": _run("d", "sglang_round_robin", 10,
                                                           stale={"requests": 4, "affine": 3,
                                                                  "stale": 3,
                                                                  "stale_tokens": 48})}),
        _result("pd", {"cortex": _run("e", "cortex", 50, 50, decode_pool={
            "decode-0": {"requests": 4}})}),
    ]
    results[4].skipped["vllm_cache_aware"] = "vllm-router is not installed"
    md = report_markdown(results, _config())
    targets = {(t["workload"], t["target"]): t["met"]
               for t in report_json(results, _config())["targets"]}
    assert targets[("shared_prefix replicas", "4 replicas within 2 points of 1")] is True
    assert targets[("churn", "no over-prediction on the restart worker after its events")]
    assert not targets[("churn", "no over-prediction on the flush worker after its events")]
    for heading in ("## Router replicas behind a load balancer", "## Churn", "## KV pressure",
                    "## Prefill/decode pools", "## Contenders that could not run here"):
        assert heading in md
    assert "| shared_prefix | sglang_cache_aware | 80.0% · 10.0 / 10.0 | 50.0% · 10.0 / 10.0 |"\
        " -30.0 points |" in md
    assert "3 of 4 (stale sends)" in md and "vllm-router is not installed" in md
    doc = report_json(results, _config())
    assert doc["variants"]["shared_prefix_r4"]["replicas"] == 4
    assert doc["variants"]["pd"]["skipped"] == {"vllm_cache_aware": "vllm-router is not"
                                                " installed"}
    written = {p.name for p in write_plots(results, tmp_path)}
    assert "replicas.png" in written and (tmp_path / "replicas.png").stat().st_size > 1000


def test_cortex_timing_line_says_what_the_gateway_did_not_time() -> None:
    gateway = {"decisions": {"exact_kv/hit": 4},
               "routing_ms_mean": {"first token out": 25.4, "total": 1.1}}
    results = [_result("agents", {"cortex": _run("a", "cortex", 80, 80, gateway=gateway,
                                                 ttft_mean_ms=26.9)})]
    md = report_markdown(results, _config())
    assert ("first token out 25.40, total 1.10; the client's mean TTFT minus the gateway's"
            " first token out (the connection, the HTTP server, the client): 1.50 ms.") in md
    gateway["routing_ms_mean"] = {"total": 1.1}  # an older gateway: no first token out
    assert "minus the gateway's" not in report_markdown(results, _config())

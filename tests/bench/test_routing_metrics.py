"""Metrics, verification, bounds and targets of ``cortex bench routing`` (pure)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from cortex.bench.routing.bounds import (
    PromptShape,
    cacheable_tokens,
    infinite_cache_hit_rate,
    nominal_order,
    page_keys,
    pooled_lru_hit_rate,
    unique_pages,
)
from cortex.bench.routing.metrics import EngineTotals, Outcome, percentile, summarize
from cortex.bench.routing.report import WorkloadResult, evaluate_targets, report_json
from cortex.bench.routing.workloads import Endpoint, Request, Workload


def test_percentile_matches_numpy() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


# ---- bounds ---------------------------------------------------------------------------------


def test_page_keys_are_chained() -> None:
    a = page_keys(list(range(40)), 16)
    b = page_keys([*range(16), 99, *range(17, 40)], 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert page_keys([1, 2, 3], 16) == ()


def test_engine_rule_last_token_is_computed() -> None:
    shape = PromptShape(32, page_keys(list(range(32)), 16))
    assert cacheable_tokens(shape, 2, 16) == 16       # (32 - 1) // 16 = 1 page at most
    assert cacheable_tokens(PromptShape(33, shape.pages), 2, 16) == 32
    assert cacheable_tokens(shape, 0, 16) == 0


def _shape(tokens: list[int]) -> PromptShape:
    return PromptShape(len(tokens), page_keys(tokens, 4))


def test_infinite_and_pooled_lru_bounds() -> None:
    p = [1, 2, 3, 4, 5, 6, 7, 8]
    shapes = [_shape([*p, 9]), _shape([*p, 10]), _shape([50, 51, 52, 53, 54]),
              _shape([*p, 11])]
    # 0 + 8 + 0 + 8 cached of 9 + 9 + 5 + 9
    assert infinite_cache_hit_rate(shapes, [0, 1, 2, 3], 4) == pytest.approx(16 / 32)
    assert pooled_lru_hit_rate(shapes, [0, 1, 2, 3], 4, 100) == pytest.approx(16 / 32)
    # room for two pages: request 2's page pushes request 0's leaf page out, the root stays
    assert pooled_lru_hit_rate(shapes, [0, 1, 2, 3], 4, 2) == pytest.approx((8 + 4) / 32)
    assert unique_pages(shapes) == 3


def test_nominal_order_follows_chains() -> None:
    reqs = (Request(0, Endpoint.COMPLETIONS, 1, 1.0, prompt="a"),
            Request(1, Endpoint.COMPLETIONS, 1, 0.5, prompt="b"),
            Request(2, Endpoint.COMPLETIONS, 1, 0.2, prompt="c", after=1),
            Request(3, Endpoint.COMPLETIONS, 1, 2.0, prompt="d", after=0))
    assert nominal_order(Workload("w", "t", "s", reqs)) == [1, 2, 0, 3]


# ---- summaries and verification -------------------------------------------------------------


def _outcome(i: int, prompt: int = 100, cached: int = 50, *, predicted: int | None = None,
             error: str | None = None, digest: str | None = None) -> Outcome:
    o = Outcome(i, digest or f"d{i}", scheduled_s=i * 0.1, sent_s=i * 0.1 + 0.001)
    if error is not None:
        o.error = error
        return o
    o.ttft_s, o.done_s = 0.010 * (i + 1), i * 0.1 + 0.5
    o.prompt_tokens, o.cached_tokens, o.completion_tokens = prompt, cached, 4
    o.predicted_hit_tokens = predicted
    return o


def _summary(outcomes: list[Outcome], n: int = 4, **kw: Any) -> Any:
    return summarize("w", "c", outcomes, [f"d{i}" for i in range(n)], [100] * n, [4] * n, **kw)


def test_summary_numbers() -> None:
    outs = [_outcome(i, cached=c, predicted=p)
            for i, (c, p) in enumerate([(0, 0), (50, 48), (96, 96), (10, 32)])]
    s = _summary(outs, workers={"a": EngineTotals(3, 300, 146), "b": EngineTotals(1, 100, 10)})
    assert s.hit_rate == pytest.approx(156 / 400)
    assert s.ttft_ms[0] == pytest.approx(25.0)
    assert s.throughput_rps == pytest.approx(4 / (0.8 - 0.001))
    assert s.verified and s.engine_agrees and s.problems == []
    assert s.imbalance("requests") == pytest.approx(1.5)
    assert s.imbalance("uncached_tokens") == pytest.approx(154 / 122)
    p = s.prediction
    assert p is not None and (p.exact, p.under, p.over) == (2, 1, 1)
    assert p.over_tokens == 22 and p.over_fraction == 0.25 and p.abs_error_tokens == 24


def test_a_run_cannot_pass_with_fewer_different_or_failed_requests() -> None:
    full = [_outcome(i) for i in range(4)]
    assert _summary(full).verified
    fewer = _summary(full[:3])
    assert not fewer.verified and fewer.failures["not sent"] == 1
    assert any("sent 3 of 4" in p for p in fewer.problems)
    changed = _summary([*full[:3], _outcome(3, digest="other")])
    assert changed.digest_mismatches == 1 and not changed.verified
    failed = _summary([*full[:3], _outcome(3, error="http 503")])
    assert failed.failures == {"http 503": 1} and failed.requests_ok == 3 and not failed.verified
    short = _summary([*full[:3], _outcome(3, prompt=99)])
    assert short.prompt_mismatches == 1 and not short.verified
    engines = _summary(full, workers={"a": EngineTotals(3, 300, 150)})
    assert not engines.engine_agrees and not engines.verified


def test_stages_are_summarized_separately() -> None:
    outs = [_outcome(i, cached=(0 if i < 2 else 100)) for i in range(4)]
    s = _summary(outs, stage_of=[0, 0, 1, 1], stage_rates=[5.0, 10.0])
    assert [(st.rate, st.requests, st.hit_rate) for st in s.stages] == [(5.0, 2, 0.0),
                                                                         (10.0, 2, 1.0)]


def test_targets_and_json() -> None:
    w = Workload("shared_prefix", "t", "s",
                 tuple(Request(i, Endpoint.COMPLETIONS, 4, 0.0, prompt="x") for i in range(4)))
    res = WorkloadResult(w, 400, infinite_bound=0.6, pooled_bound=0.6, unique_pages=10,
                         capacity_blocks=4, offered_prefill_load=0.5)
    res.runs["cortex"] = summarize("shared_prefix", "cortex", [_outcome(i, cached=55,
                                                                        predicted=55)
                                                               for i in range(4)],
                                   [f"d{i}" for i in range(4)], [100] * 4, [4] * 4)
    res.runs["sglang_cache_aware"] = summarize("shared_prefix", "sglang_cache_aware",
                                               [_outcome(i, cached=40) for i in range(4)],
                                               [f"d{i}" for i in range(4)], [100] * 4, [4] * 4)
    res.runs["sglang_round_robin"] = summarize("shared_prefix", "sglang_round_robin",
                                               [_outcome(i, cached=30) for i in range(4)],
                                               [f"d{i}" for i in range(4)], [100] * 4, [4] * 4)
    targets = {t.name: t for t in evaluate_targets([res])}
    assert targets["hit rate >= the best peer's"].met is True
    assert targets["hit rate >= 2x round robin"].met is False     # 55 / 30 = 1.83
    assert targets[">= 90% of the infinite-cache bound"].met is True
    assert targets["over-predicted hits on < 1% of requests"].met is True
    assert targets["TTFT p50 < the best peer's"].met is False  # same latencies
    doc = report_json([res], {"command": "x"})
    run = doc["runs"][0]
    for key in ("workload", "contender", "requests_sent", "requests_ok", "prompt_tokens",
                "cached_tokens", "hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                "throughput_rps"):
        assert key in run
    assert [r["contender"] for r in doc["runs"]] == ["cortex", "sglang_cache_aware",
                                                     "sglang_round_robin"]
    assert doc["bounds"] == {"shared_prefix": 0.6}
    res.pooled_bound = 0.3
    capped = {t.name: t for t in evaluate_targets([res])}
    assert capped[">= 90% of the infinite-cache bound"].met is None
    # a peer that answered nothing (a path it does not serve) is no yardstick
    failed = [_outcome(i, cached=0) for i in range(4)]
    for o in failed:
        o.error = "http 404"
    res.runs["vllm_consistent_hash"] = summarize(
        "shared_prefix", "vllm_consistent_hash", failed, [f"d{i}" for i in range(4)],
        [100] * 4, [4] * 4)
    targets = {t.name: t for t in evaluate_targets([res])}
    assert "vllm_consistent_hash" not in targets["TTFT p50 < the best peer's"].detail
    assert "sglang_cache_aware" in targets["hit rate >= the best peer's"].detail
    assert targets["every run verified"].met is False


def test_reuse_totals_and_the_order_they_must_keep() -> None:
    outs = [_outcome(i, cached=c) for i, c in enumerate([0, 48, 96, 10])]
    for o, (available, captured) in zip(outs, [(0, 0), (64, 48), (96, 96), (64, 0)],
                                        strict=True):
        o.reuse_available, o.reuse_captured = available, captured
    r = _summary(outs).reuse
    assert r is not None and (r.requests, r.available, r.captured, r.delivered) == (
        4, 224, 144, 154)
    assert (r.captured_over_available, r.delivered_over_captured) == (0, 1) and not r.holds
    assert _summary([_outcome(i) for i in range(4)]).reuse is None  # a peer: not measurable

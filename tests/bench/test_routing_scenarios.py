"""Deployment variants, stale sends and churn windows of ``cortex bench routing`` (pure)."""

from __future__ import annotations

import math

import pytest

from cortex.bench.routing.bounds import PromptShape
from cortex.bench.routing.metrics import Outcome
from cortex.bench.routing.scenarios import (
    VARIANTS,
    ChurnAction,
    stale_sends,
    window_stats,
)

PAGE = 16


def _answered(i: int, sent: float, ttft: float, cached: int, prompt: int = 64,
              predicted: int | None = None) -> Outcome:
    o = Outcome(i, f"d{i}", sent, sent)
    o.ttft_s, o.done_s = ttft, sent + ttft + 0.1
    o.prompt_tokens, o.cached_tokens, o.completion_tokens = prompt, cached, 4
    o.predicted_hit_tokens = predicted
    return o


def test_variants_name_their_base_and_shape() -> None:
    assert [VARIANTS[f"shared_prefix_r{n}"].replicas for n in (1, 2, 4)] == [1, 2, 4]
    assert {VARIANTS[f"multi_turn_r{n}"].group for n in (1, 2, 4)} == {"multi_turn"}
    churn = VARIANTS["churn"]
    assert [e.action for e in churn.churn] == [ChurnAction.RESTART, ChurnAction.FLUSH]
    assert churn.churn[0].worker != churn.churn[1].worker
    assert VARIANTS["kv_pressure"].capacity_fraction == 0.1
    assert VARIANTS["mooncake_real_scale"].real_tokens and VARIANTS["pd"].pd
    for v in VARIANTS.values():
        assert "cortex" in v.contenders and not (v.pd and v.replicas)


def test_a_send_to_the_last_holder_that_finds_less_is_stale() -> None:
    # four pages each: 0 and 1 share three leading pages, 2 shares them too
    shapes = [PromptShape(64, (1, 2, 3, 4)), PromptShape(64, (1, 2, 3, 5)),
              PromptShape(64, (1, 2, 3, 6)), PromptShape(64, (9, 8, 7, 6))]
    outs = [_answered(0, 0.0, 0.1, 0),
            _answered(1, 1.0, 0.1, 48),   # on w0 after 0 was served there: 48 cached, fine
            _answered(2, 2.0, 0.1, 0),    # on w0 again, found nothing: stale (48 expected)
            _answered(3, 3.0, 0.1, 0)]    # a prefix never served: not affine
    s = stale_sends(shapes, outs, {0: "w0", 1: "w0", 2: "w0", 3: "w0"}, PAGE)
    assert s is not None and (s.requests, s.affine, s.stale, s.stale_tokens) == (4, 2, 1, 48)
    assert s.stale_fraction == 0.25
    # the same sends to another worker than the last holder are not affine at all
    other = stale_sends(shapes, outs, {0: "w0", 1: "w1", 2: "w0", 3: "w1"}, PAGE)
    assert other is not None and (other.affine, other.stale) == (0, 0)


def test_a_prefix_counts_as_served_only_once_its_first_token_went_out() -> None:
    shapes = [PromptShape(64, (1, 2, 3, 4)), PromptShape(64, (1, 2, 3, 5))]
    # request 1 is sent before request 0's first token: its prefix is not on w0 yet
    outs = [_answered(0, 0.0, 0.5, 0), _answered(1, 0.2, 0.1, 0)]
    s = stale_sends(shapes, outs, {0: "w0", 1: "w0"}, PAGE)
    assert s is not None and (s.affine, s.stale) == (0, 0)
    assert stale_sends(shapes, outs, {}, PAGE) is None


def test_window_stats_count_the_requests_sent_inside() -> None:
    outs = [_answered(0, 0.5, 0.01, 0, predicted=0),
            _answered(1, 1.5, 0.02, 32, predicted=48),   # over-predicted, on w0
            _answered(2, 2.5, 0.03, 64, predicted=64),
            _answered(3, 3.5, 0.04, 0)]
    worker_of = {0: "w0", 1: "w0", 2: "w1", 3: "w0"}
    w = window_stats(outs, worker_of, "w0", 1.0, 3.0)
    assert (w.requests, w.worker_requests, w.over_predictions) == (2, 1, 1)
    assert w.hit_rate == pytest.approx(96 / 128) and w.worker_hit_rate == 0.5
    assert w.ttft_p50_ms == pytest.approx(25.0)
    empty = window_stats(outs, worker_of, "w0", 10.0, 20.0)
    assert empty.requests == 0 and math.isnan(empty.hit_rate)

"""Reuse accounting: available, captured, given up (pure), and its counters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.gateway.config.gateway import RoutingWeights
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.scoring import Candidate, GivenUp, Reuse, count_reuse, decide, reuse_of
from cortex.ledger.model import LedgerState

W = RoutingWeights()
READY = LedgerState.READY


def cand(worker: str, **kw: object) -> Candidate:
    base: dict[str, object] = {"engine_running": 0, "engine_waiting": 0, "ledger": READY}
    base.update(kw)
    return Candidate(worker, **base)  # type: ignore[arg-type]


def test_a_captured_hit_gives_nothing_up() -> None:
    d = decide([cand("a", index_tokens=512), cand("b", index_tokens=128)], W)
    assert reuse_of(d, "a") == Reuse(512, 512)
    assert reuse_of(d, "a").header() == b"available=512; captured=512; given_up=none"


def test_what_the_decision_gave_up_and_why() -> None:
    hot = cand("hot", index_tokens=4096, inflight=8, high_watermark=8)
    d = decide([hot, cand("warm", index_tokens=1024)], W)
    assert reuse_of(d, "warm") == Reuse(4096, 1024, "over_watermark")
    d = decide([cand("busy", index_tokens=128, inflight=4), cand("idle")], W)
    assert reuse_of(d, "idle") == Reuse(128, 0, GivenUp.LOAD)
    d = decide([cand("a", index_tokens=512), cand("b")], W)
    assert reuse_of(d, "b") == Reuse(512, 0, GivenUp.RETRY)  # a failed, b served it
    d = decide([cand("full", index_tokens=1024, kv_pressure=1.0), cand("free")], W,
               prompt_tokens=4096)
    assert reuse_of(d, "free") == Reuse(1024, 0, GivenUp.KV_PRESSURE)


def test_held_but_uncredited_tokens_are_available_only_from_ready_ledgers() -> None:
    d = decide([cand("stale", index_tokens=4096, ledger=LedgerState.STALE), cand("b")], W)
    assert reuse_of(d, "b") == Reuse(0, 0)


def test_available_per_tier_says_what_was_on_device_when_a_tier_held_the_rest() -> None:
    # 'offload' holds 256 tokens on device and 768 more in its host tier; 'gpu' 512 on device
    d = decide([cand("offload", index_tokens=256, host_tokens=768), cand("gpu",
                                                                         index_tokens=512)], W)
    reuse = reuse_of(d, d.chosen.worker_id)
    assert (reuse.available, reuse.device) == (1024, 512)
    assert b"; available_device=512" in reuse.header()
    assert reuse.log_fields()["reuse_available_device"] == 512
    # all of it on device: no tier field (the header as before)
    d = decide([cand("a", index_tokens=512, host_tokens=0)], W)
    assert reuse_of(d, "a").device is None
    assert reuse_of(d, "a").log_fields()["reuse_available_device"] == 512
    m = GatewayMetrics()
    count_reuse(m, "m", "w1", Reuse(1024, 1024, delivered=1024, device=512), 2000)
    count_reuse(m, "m", "w1", Reuse(256, 256, delivered=256), 2000)
    assert m.registry.get_sample_value("cortex_gateway_reuse_tokens_total", {
        "worker": "w1", "model": "m", "kind": "available_device"}) == 768


def test_counted_only_with_the_engines_number() -> None:
    m = GatewayMetrics()
    count_reuse(m, "m", "w1", Reuse(512, 256, GivenUp.LOAD), 1000)
    count_reuse(m, "m", "w1", Reuse(512, 256, GivenUp.LOAD, 128), 1000)
    r = m.registry

    def value(name: str, **labels: str) -> float | None:
        return r.get_sample_value(name, labels)

    assert value("cortex_gateway_reuse_unreported_total", model="m") == 1
    assert value("cortex_gateway_reuse_tokens_total", worker="w1", model="m",
                 kind="available") == 512
    assert value("cortex_gateway_reuse_tokens_total", worker="w1", model="m",
                 kind="captured") == 256
    assert value("cortex_gateway_reuse_tokens_total", worker="w1", model="m",
                 kind="delivered") == 128
    assert value("cortex_gateway_reuse_prompt_tokens_total", worker="w1", model="m") == 1000
    assert value("cortex_gateway_reuse_given_up_tokens_total", model="m", reason="load") == 256


_candidates = st.lists(st.builds(
    cand, st.sampled_from("abcdefgh"),
    index_tokens=st.integers(0, 64) .map(lambda b: b * 16),
    predicted_tokens=st.integers(0, 64).map(lambda b: b * 16),
    session_tokens=st.integers(0, 64).map(lambda b: b * 16),
    host_tokens=st.integers(0, 64).map(lambda b: b * 16),
    inflight=st.integers(0, 80), session=st.booleans(), sessions=st.integers(0, 10),
    kv_pressure=st.floats(0, 1), ledger=st.sampled_from([READY, LedgerState.STALE])),
    min_size=1, max_size=6, unique_by=lambda c: c.worker_id)


@settings(max_examples=300, deadline=None)
@given(_candidates, st.integers(0, 7), st.integers(0, 2048))
def test_captured_never_exceeds_available_whoever_serves(cands: list[Candidate], pick: int,
                                                         prompt: int) -> None:
    d = decide(cands, W, prompt_tokens=prompt, prefix_key=pick)
    for scored in d.ranked:
        reuse = reuse_of(d, scored.worker_id)
        assert 0 <= reuse.captured <= reuse.available
        assert reuse.device is None or 0 <= reuse.device < reuse.available
        assert (reuse.given_up == GivenUp.NONE) == (reuse.lost == 0)
    assert reuse_of(d, d.chosen.worker_id).captured >= d.hit_tokens

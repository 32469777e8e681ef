"""The decision headers: one builder, the header set and order clients have always seen."""

from __future__ import annotations

import pytest

from cortex.gateway.api.inference import NOT_ROUTED, decision_headers
from cortex.gateway.dispatch.pd.legs import error_in
from cortex.gateway.routing.scoring import PDMode, PDOutcome

pytestmark = pytest.mark.timeout(10)


def test_a_served_request_carries_every_field_in_order() -> None:
    headers = decision_headers(hit_tokens=64, worker="w1", mode="cache_aware", reason="hit",
                               attempts=2)
    assert headers == [(b"x-cortex-cache-hit-tokens", b"64"),
                       (b"x-cortex-assigned-worker", b"w1"),
                       (b"x-cortex-match-mode", b"cache_aware"),
                       (b"x-cortex-match-reason", b"hit"), (b"x-cortex-attempts", b"2")]


def test_pd_outcomes_and_failures() -> None:
    served = decision_headers(worker="d", pd=PDOutcome(PDMode.DISAGGREGATED, "p", "d"))
    assert served[1:] == [(b"x-cortex-pd", b"disaggregated"),
                          (b"x-cortex-prefill-worker", b"p"),
                          (b"x-cortex-decode-worker", b"d")]
    fallback = decision_headers(pd=PDOutcome(PDMode.FALLBACK, None, None))
    assert fallback[1:] == [(b"x-cortex-prefill-worker", b"none"),
                            (b"x-cortex-decode-worker", b"none")]
    failed = decision_headers(hit_tokens=0, worker="none", mode="load_aware", pd_failed=True)
    assert [name for name, _ in failed][3:] == [b"x-cortex-pd", b"x-cortex-prefill-worker",
                                                b"x-cortex-decode-worker"]
    assert failed[3] == (b"x-cortex-pd", b"failed")


def test_fields_not_given_are_left_out() -> None:
    assert NOT_ROUTED == [(b"x-cortex-cache-hit-tokens", b"0"),
                          (b"x-cortex-assigned-worker", b"none"),
                          (b"x-cortex-match-mode", b"none")]
    assert decision_headers(worker="w") == [(b"x-cortex-assigned-worker", b"w")]
    assert decision_headers() == []


@pytest.mark.parametrize(("data", "stream", "is_error"), [
    (b'data: {"error":{"message":"KVPoll.Failed"}}\n\n', True, True),
    (b'data: {"choices":[]}\n\n', True, False),
    (b'{"object":"error","message":"boom"}', False, True),
    (b'{"error":{"message":"boom"}}', False, True),
    (b'{"choices":[{"text":"error"}]}', False, False),
    (b'{"error": not json', False, False),
])
def test_an_answer_that_is_an_error_object(data: bytes, stream: bool, is_error: bool) -> None:
    assert error_in(data, stream) is is_error

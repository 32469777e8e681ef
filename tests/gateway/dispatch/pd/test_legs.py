"""The leg call's verdict on a 200: what the endpoint promises, or a ``bad_answer`` (pure)."""

from __future__ import annotations

from cortex.gateway.dispatch.pd.legs import bad_answer

SSE = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'


def test_a_non_streamed_leg_must_answer_a_json_object() -> None:
    assert bad_answer("application/json", b'{"id":"x","choices":[]}', stream=False) is None
    for body in (b"<html>upstream error</html>", b"[1, 2]", b'"text"', b"", b"[" * 100_000):
        assert bad_answer("application/json", body, stream=False) == (
            "a 200 that is not a JSON object")


def test_a_batched_generate_leg_may_answer_a_list_of_objects() -> None:
    batch = b'[{"text":"a","meta_info":{}},{"text":"b","meta_info":{}}]'
    assert bad_answer("application/json", batch, stream=False, listed=True) is None
    assert bad_answer("application/json", batch, stream=False) is not None  # not /generate
    for body in (b"[]", b'[{"text":"a"}, 3]'):
        assert bad_answer("application/json", body, stream=False, listed=True) is not None


def test_a_streamed_leg_must_answer_the_engines_sse() -> None:
    assert bad_answer("text/event-stream", SSE, stream=True) is None
    assert bad_answer("text/event-stream; charset=utf-8", SSE + b"data: [DONE]\n\n",
                      stream=True) is None
    assert bad_answer("text/event-stream", b"this is not an event stream\n\n",
                      stream=True) == "a stream that is not SSE"
    assert bad_answer("application/json", b'{"id":"x","choices":[]}', stream=True) == (
        "a 'application/json' answer to a streamed request")

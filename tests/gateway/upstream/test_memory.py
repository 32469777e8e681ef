"""The in-memory upstream answers from its script the way dispatch's tests rely on."""

from __future__ import annotations

import asyncio

import pytest

from cortex.gateway.upstream.client import FailureKind, UpstreamFailure
from cortex.gateway.upstream.memory import EVENT, MemoryUpstream, Reply
from cortex.hashing import Engine
from cortex.registry import WorkerSpec

pytestmark = pytest.mark.timeout(10)

W0 = WorkerSpec(id="w0", url="http://127.0.0.1:9000", engine=Engine.SGLANG, model="m")
W1 = WorkerSpec(id="w1", url="http://127.0.0.1:9001", engine=Engine.SGLANG, model="m")


async def test_replies_in_order_then_the_last_repeats() -> None:
    upstream = MemoryUpstream({"w0": [Reply(503, (b"busy",), retry_after_s=2.0), Reply()]})
    first = await upstream.post(W0.url + "/v1/completions", b"a", {}, W0)
    assert (first.status, await first.read(), first.retry_after_s) == (503, b"busy", 2.0)
    for body in (b"b", b"c"):
        answer = await upstream.post(W0.url + "/v1/completions", body, {}, W0)
        assert [part async for part in answer.chunks()] == [EVENT, b"data: [DONE]\n\n"]
        answer.close()
    assert upstream.sent == [("w0", b"a"), ("w0", b"b"), ("w0", b"c")]
    assert [r.closed for r in upstream.responses] == [False, True, True]


async def test_a_failure_raises_at_the_send_and_a_hang_never_answers() -> None:
    upstream = MemoryUpstream({"w0": [Reply(fail=FailureKind.CONNECT)], "w1": [Reply(hang=True)]})
    with pytest.raises(UpstreamFailure) as failed:
        await upstream.post(W0.url, b"x", {}, W0)
    assert failed.value.kind is FailureKind.CONNECT and upstream.responses == []
    hung = asyncio.ensure_future(upstream.post(W1.url, b"y", {}, W1))
    await asyncio.sleep(0)  # the send is made, its answer never comes
    assert upstream.reached() == ["w0", "w1"] and not hung.done()
    hung.cancel()


async def test_a_send_must_name_its_worker() -> None:
    upstream = MemoryUpstream({"w0": [Reply()]})
    with pytest.raises(ValueError):
        await upstream.post(W1.url, b"x", {}, W0)
    with pytest.raises(ValueError):
        await upstream.post(W0.url, b"x", {})

"""Worker addresses at ingest (cortex.ingest.service): a spec whose event endpoint is on a
link-local or metadata address is never subscribed to; the others are, from the same
registry read (real Redis, ZMQ and index)."""

from __future__ import annotations

import pytest

from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.testing import wait_until_async

from .conftest import Fleet

pytestmark = pytest.mark.timeout(60)


async def test_a_spec_on_a_denied_address_is_never_subscribed_to(fleet: Fleet) -> None:
    ingest = await fleet.ingest()
    await fleet.registry.register(WorkerSpec(
        id="metadata", url="http://10.0.0.1:30000", engine=Engine.SGLANG, model="m",
        kv_events="tcp://169.254.169.254:5557"), 30)
    good = await fleet.add_worker("good")
    await wait_until_async(lambda: "good" in ingest.sessions, timeout=10,
                           what="the registry read")
    assert "metadata" not in ingest.sessions
    fleet.traffic(good, 5)
    await fleet.wait_converged(good, ingest)

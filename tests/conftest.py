"""Fixtures shared by the whole suite. Area-specific fixtures live in each area's conftest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from cortex.testing import RedisServer

# Property tests check results, never speed: on a shared 2-core CI machine, generating a
# large example can be slow for reasons unrelated to the code under test.
settings.register_profile("cortex", suppress_health_check=[HealthCheck.too_slow],
                          deadline=None)
settings.load_profile("cortex")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, for one test (never the machine's 6379)."""
    with RedisServer() as server:
        yield server

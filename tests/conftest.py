"""Fixtures shared by the whole suite. Area-specific fixtures live in each area's conftest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cortex.testing import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free port, for one test (never the machine's 6379)."""
    with RedisServer() as server:
        yield server

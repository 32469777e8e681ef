"""Fixtures shared by the whole suite. Area-specific fixtures live in each area's conftest."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

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


@pytest.fixture(scope="session")
def install_script() -> ModuleType:
    """``docker/install.py``, the script every image's build runs (it knows the repository's
    distributions: the import-boundary and image tests read them through it)."""
    path = Path(__file__).resolve().parents[1] / "docker/install.py"
    spec = importlib.util.spec_from_file_location("cortex_image_install", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

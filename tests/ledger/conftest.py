"""Every ledger test runs against both tree cores: the compiled one and its pure-Python
specification (a missing build fails the native half loudly)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cortex.ledger import cores


@pytest.fixture(autouse=True, params=list(cores.Core), ids=lambda core: f"core={core}")
def tree_core(request: pytest.FixtureRequest) -> Iterator[cores.Core]:
    """The core every tree built during the test uses."""
    before = cores.active()
    cores.use(request.param)
    yield request.param
    cores.use(before)

"""The README's quickstart, exactly as written, against the cluster ``make up`` starts.

The sims keep ``cortex up``'s default timing (not zero-cost): a request takes long enough
for an engine load poll to see it running, which is what once sent a sequential client's
repeat to the other worker (the polled count said the holder was still busy).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex.devcluster.cluster import LocalCluster

from .conftest import acceptance_spec

pytestmark = pytest.mark.slow

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
REPEATS = 20


def quickstart_curl() -> str:
    """The quickstart's request: the README's ``curl`` to the gateway's chat endpoint."""
    quickstart = README.split("## Quickstart", 1)[1]
    found = re.search(r"^(curl -si http://127\.0\.0\.1:8080/v1/chat/completions.*?)\n```",
                      quickstart, re.MULTILINE | re.DOTALL)
    assert found, "the README's quickstart has no curl to /v1/chat/completions"
    return found.group(1)


def run(curl: str) -> dict[str, str]:
    result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    head = result.stdout.partition("\n\n")[0]
    assert head.startswith("HTTP/1.1 200"), result.stdout
    return dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(acceptance_spec(zero_cost=False), tmp_path_factory.mktemp("qs")) as c:
        yield c


def test_every_repeat_of_the_quickstart_request_lands_on_its_holder(
    cluster: LocalCluster,
) -> None:
    curl = quickstart_curl().replace("http://127.0.0.1:8080", cluster.gateway_urls[0])
    first = run(curl)
    assert first["x-cortex-match-mode"] == "load_aware"
    assert first["x-cortex-cache-hit-tokens"] == "0"
    holder = first["x-cortex-assigned-worker"]

    repeats = [run(curl) for _ in range(REPEATS)]

    assert [(r["x-cortex-assigned-worker"], r["x-cortex-match-mode"]) for r in repeats] == [
        (holder, "exact_kv")] * REPEATS
    assert {int(r["x-cortex-cache-hit-tokens"]) for r in repeats} == {48}

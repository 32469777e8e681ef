"""Helpers of the acceptance tests: whole clusters in child processes, as ``cortex up`` runs them.

Every cluster is a :class:`cortex.devcluster.cluster.LocalCluster` (private redis-server, index,
ingest, gateways, ``cortex sim`` workers on 127.0.0.1) with zero-cost sims and a short lease,
so a test costs seconds. Requests go over real HTTP; decisions are read from the
``x-cortex-*`` headers and checked against what the engine reports (``cached_tokens``).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from cortex.devcluster.cluster import ClusterSpec, LocalCluster
from cortex.testing import wait_until_async

LEASE_TTL_S = 3.0


def acceptance_spec(**overrides: Any) -> ClusterSpec:
    """Two zero-cost SGLang sims, free ports, a 3 s lease (probes every 0.75 s)."""
    values: dict[str, Any] = {"workers": 2, "gateways": 1, "port": 0, "zero_cost": True,
                              "lease_ttl_s": LEASE_TTL_S, "ready_timeout_s": 60.0}
    values.update(overrides)
    return ClusterSpec(**values)


def long_prompt(tag: str, words: int = 900) -> str:
    """A long system prompt (~2,000 tokens) that no other test shares."""
    rng = random.Random(tag)
    vocabulary = ["cache", "prefix", "worker", "block", "token", "ledger", "route", "replica",
                  "stream", "event", "index", "lease", "budget", "engine", "decode", "prefill"]
    body = " ".join(rng.choice(vocabulary) + str(rng.randrange(100)) for _ in range(words))
    return f"[{tag}] You are the cluster's assistant. House rules follow. {body}"


def chat(system: str, question: str, model: str = "cortex-sim") -> dict[str, Any]:
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}


@dataclass
class Reply:
    """One answered request: status, decision headers and the engine's cached tokens."""

    status: int
    headers: dict[str, str]
    cached_tokens: int | None
    body: Any = field(repr=False)

    @property
    def worker(self) -> str:
        return self.headers.get("x-cortex-assigned-worker", "")

    @property
    def mode(self) -> str:
        return self.headers.get("x-cortex-match-mode", "")

    @property
    def hit_tokens(self) -> int:
        return int(self.headers.get("x-cortex-cache-hit-tokens", "0"))


class Client:
    """Talks to a running cluster's gateways (index ``gateway`` into ``gateway_urls``)."""

    def __init__(self, cluster: LocalCluster, http: aiohttp.ClientSession) -> None:
        self.cluster = cluster
        self.http = http
        self.admin = {"Authorization": f"Bearer {cluster.admin_token}"}

    async def chat(self, body: dict[str, Any], gateway: int = 0) -> Reply:
        url = self.cluster.gateway_urls[gateway] + "/v1/chat/completions"
        async with self.http.post(url, json=body) as resp:
            payload = await resp.json()
            cached = None
            if resp.status == 200:
                cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, cached,
                         payload)

    async def explain(self, body: dict[str, Any], gateway: int = 0) -> dict[str, Any]:
        url = self.cluster.gateway_urls[gateway] + "/admin/explain"
        async with self.http.post(url, json=body, headers=self.admin) as resp:
            assert resp.status == 200, await resp.text()
            explained: dict[str, Any] = await resp.json()
            return explained

    async def index_tokens(self, body: dict[str, Any], gateway: int = 0) -> dict[str, int]:
        """Per candidate worker: leading prompt tokens the *index* credits (no predictions)."""
        explained = await self.explain(body, gateway)
        return {c["worker"]: c["index_tokens"] for c in explained["candidates"]}

    async def wait_indexed(self, body: dict[str, Any], worker: str, gateway: int = 0,
                           timeout: float = 15.0) -> None:
        """Wait until the index (through ``gateway``) credits ``worker`` with the prompt."""

        async def held() -> bool:
            return (await self.index_tokens(body, gateway)).get(worker, 0) > 0

        await wait_until_async(held, timeout=timeout, interval=0.05,
                               what=f"the index to credit {worker}")

    async def workers(self, gateway: int = 0) -> dict[str, Any]:
        url = self.cluster.gateway_urls[gateway] + "/admin/workers"
        async with self.http.get(url, headers=self.admin) as resp:
            assert resp.status == 200, await resp.text()
            listing = await resp.json()
            return {w["id"]: w for w in listing["workers"]}

    async def text(self, url: str) -> str:
        async with self.http.get(url) as resp:
            assert resp.status == 200, url
            return await resp.text()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session

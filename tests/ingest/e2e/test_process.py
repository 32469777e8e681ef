"""``cortex ingest run`` as a real process: killed for good, its ledgers lose exact-KV credit
at the index after the grace while another shard's stay READY; restarted, they are READY again.
Real Redis, real ZMQ publishers, a real index on 127.0.0.1."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from grpclib.client import Channel

from cortex.index.server import IndexServer
from cortex.ingest.forwarder import ForwarderConfig
from cortex.ingest.shard import ShardSpec, shard_of
from cortex.ledger.client import IndexStub, match_request
from cortex.ledger.codec import pb
from cortex.ledger.model import Source
from cortex.testing import wait_until_async

from ..conftest import MODEL, Fleet, index_config

GRACE = 2.0


class IngestProcess:
    """One ``cortex ingest run`` child; :meth:`start` (re)launches it with the same flags."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv = argv
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def stop(self, sig: signal.Signals, timeout: float = 20.0) -> int:
        proc = self.proc
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(sig)
        await wait_until_async(lambda: proc.poll() is not None, timeout=timeout,
                               what=f"ingest to exit on {sig.name}")
        assert proc.returncode is not None
        return proc.returncode

    def reap(self) -> None:
        """Never leave a child behind (a failed test included)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def children() -> Iterator[list[IngestProcess]]:
    started: list[IngestProcess] = []
    yield started
    for child in started:
        child.reap()


@contextlib.asynccontextmanager
async def index_stub(srv: IndexServer) -> AsyncIterator[IndexStub]:
    channel = Channel("127.0.0.1", srv.port)
    try:
        yield IndexStub(channel)
    finally:
        channel.close()


async def match_state(stub: IndexStub, worker_id: str) -> tuple[pb.LedgerState, int]:
    """(state, matched blocks) of ``worker_id`` for a prompt its cache holds (prefix pool 0)."""
    prefix = [1000 + i for i in range(12)]  # Fleet.prompt's pool 0: 3 blocks of 4 tokens
    reply = await stub.match(match_request(MODEL, token_ids=prefix,
                                           candidate_workers=[worker_id]))
    (only,) = reply.matches
    return only.state, only.matched_blocks


async def test_a_killed_ingest_loses_credit_after_the_grace_and_a_restart_restores_it(
    fleet: Fleet, tmp_path: Path, children: list[IngestProcess]
) -> None:
    srv = await fleet.stack.enter_async_context(
        IndexServer(index_config(ingest_grace_s=GRACE))
    )
    fleet.index = [srv]
    # one worker per shard of two: the child process owns "gpu-2", the in-process one "gpu-0"
    assert shard_of("gpu-2", 2) == 0 and shard_of("gpu-0", 2) == 1
    mine = await fleet.add_worker("gpu-2")
    other = await fleet.add_worker("gpu-0")
    child = IngestProcess(
        [sys.executable, "-m", "cortex.edge.main", "ingest", "run",
         "--redis", fleet.redis.url, "--index", srv.target, "--shard", "0/2",
         "--ingest-id", "shard-0", "--metrics-port", "-1", "--poll-interval", "0.1",
         "--replay-timeout", "0.5", "--heartbeat", "0.2", "--log-level", "WARNING"],
        tmp_path / "ingest.log",
    )
    children.append(child)
    child.start()
    peer = await fleet.ingest(
        shard=ShardSpec(1, 2), ingest_id="shard-1",
        forwarder=ForwarderConfig(backoff_min_s=0.05, backoff_max_s=0.2, heartbeat_s=0.2),
    )
    for _ in range(3):  # every pool's prefix gets cached (Fleet.prompt picks among 6)
        fleet.traffic(mine, 20)
        fleet.traffic(other, 20)
    await fleet.wait_converged(mine, timeout=30)  # the child process fed the index
    await fleet.wait_converged(other, peer)
    async with index_stub(srv) as stub:
        assert (await match_state(stub, "gpu-2"))[0] == pb.LEDGER_STATE_READY
        assert srv.core.owners.owner(Source("gpu-2")) == "shard-0"
        assert srv.core.owners.owner(Source("gpu-0")) == "shard-1"

        killed = time.monotonic()  # before the kill: the index can only hear of it later
        await child.stop(signal.SIGKILL)  # dies for good: no goodbye on the Sync stream
        fleet.traffic(mine, 10)  # the engine goes on caching: nobody tells the index

        async def demoted() -> bool:
            return (await match_state(stub, "gpu-2")) == (pb.LEDGER_STATE_SYNCING, 0)

        await wait_until_async(demoted, timeout=GRACE + 15, what="gpu-2 no longer READY")
        assert time.monotonic() - killed >= GRACE  # the grace is honoured
        workers = {w.source.worker_id: w for w in srv.core.workers()}
        assert workers["gpu-2"].reason == "ingest_lost"
        # the other shard's ledger is untouched and keeps its credit
        state, blocks = await match_state(stub, "gpu-0")
        assert state == pb.LEDGER_STATE_READY and blocks == 3
        await fleet.wait_converged(other, peer)

        child.start()  # the same shard comes back: snapshots, replay, READY again
        await fleet.wait_converged(mine, timeout=30)
        assert (await match_state(stub, "gpu-2"))[0] == pb.LEDGER_STATE_READY
        assert not srv.core.owners.is_lost("shard-0")
        assert await child.stop(signal.SIGTERM) == 0, child.output()

"""``cortex bench transport``: CPU per message of the index's streams, Cortex frames against
gRPC (grpclib's HTTP/2), at both ends.

A child process serves a `GrpcServer` (the index's server class: one port, both
transports) with two handlers shaped like the index's streams: *Sync* answers each
ingest-sized `UpdateBatch` (64 one-block stores) with a `SyncReply`, one batch in flight;
*Replicate* streams replica-sized messages (the bytes of 64 stores) one way, one every
0.5 ms (each arrives alone, as the index's flushes do). The parent is the client. Rounds
alternate the transports; CPU is user + system seconds of each process over a round, per
message, the median of the rounds. Messages are decoded and encoded with the same codec
either way, so the difference is the transport.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpclib.const import Cardinality, Handler

from cortex.bench.procstat import cpu_s
from cortex.bench.report import cpu_model, provenance
from cortex.edge.loop import choose_loop
from cortex.hashing import Engine, HashDomain
from cortex.ingest import UpdateEncoder, encode_batch_bytes
from cortex.ledger.client import stream_channel
from cortex.ledger.codec import pb
from cortex.ledger.grpc import LedgerCodec, method
from cortex.ledger.grpc_server import GrpcServer
from cortex.ledger.model import Source

__all__ = ["run"]

SYNC = method("Sync")
REPLICATE = method("Replicate")
DOMAIN = HashDomain("bench", 16, Engine.VLLM)
STORES = 64
PACE_S = 0.0005  # between replica messages


def _batch() -> bytes:
    encoder = UpdateEncoder(Source("worker-007", 0), DOMAIN)
    keys = [(i * 0x9E3779B97F4A7C15) % (1 << 64) or 1 for i in range(1, STORES * 4 + 1)]
    chain = [keys[i:i + 4] for i in range(0, len(keys), 4)]
    return encode_batch_bytes("ingest-0", [encoder.store(7, seq, c[0], c)
                                           for seq, c in enumerate(chain, 1)])


class _Streams:
    def __init__(self) -> None:
        self.replica_bytes = _batch()

    def __mapping__(self) -> dict[str, Handler]:
        return {
            SYNC: Handler(self.sync, Cardinality.STREAM_STREAM, pb.UpdateBatch, pb.SyncReply),
            REPLICATE: Handler(self.replicate, Cardinality.STREAM_STREAM, pb.ReplicaRequest,
                               pb.ReplicaBatch),
        }

    async def sync(self, stream: Any) -> None:
        applied = 0
        async for _ in stream:
            applied += 1
            await stream.send_message(pb.SyncReply(applied_batches=applied))

    async def replicate(self, stream: Any) -> None:
        request = await stream.recv_message()
        for _ in range(int(request.replica_id)):
            await stream.send_message(self.replica_bytes)  # bytes: passed through
            await asyncio.sleep(PACE_S)


def _serve(port_out: Any) -> None:
    async def main() -> None:
        server = GrpcServer([_Streams()], codec=LedgerCodec())
        await server.start("127.0.0.1", 0)
        port_out.send(server._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()

    choose_loop().run(main())


def _cpu_of(pid: int | None) -> float:
    seconds = cpu_s(pid or 0)
    if seconds is None:
        raise RuntimeError("the serving process is gone")
    return seconds


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _sync_round(target: str, frames: bool, batch: bytes, n: int) -> None:
    channel = stream_channel(target, frames=frames)
    try:
        async with channel.request(SYNC, Cardinality.STREAM_STREAM, pb.UpdateBatch,
                                   pb.SyncReply) as call:
            for _ in range(n):
                await call.send_message(batch)  # type: ignore[arg-type]  # LedgerCodec: bytes
                await call.recv_message()
            await call.end()
            await call.recv_message()
    finally:
        channel.close()


async def _replicate_round(target: str, frames: bool, n: int) -> None:
    channel = stream_channel(target, frames=frames)
    try:
        async with channel.request(REPLICATE, Cardinality.STREAM_STREAM, pb.ReplicaRequest,
                                   pb.ReplicaBatch) as call:
            await call.send_message(pb.ReplicaRequest(replica_id=str(n)), end=True)
            while await call.recv_message() is not None:
                pass
    finally:
        channel.close()


def run(out_dir: Path, messages: int = 3000, rounds: int = 5) -> Path:
    """Measure and write ``out_dir/transport.md``; returns its path."""
    loop = choose_loop()  # the services' loop, both ends
    ctx = multiprocessing.get_context("spawn")
    port_in, port_out = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_serve, args=(port_out,), daemon=True)
    child.start()
    try:
        target = f"127.0.0.1:{port_in.recv()}"
        batch = _batch()
        cells: dict[tuple[str, bool], list[tuple[float, float]]] = {}

        async def measure() -> None:
            for _ in range(rounds):
                for shape in ("Sync", "Replicate"):
                    for frames in (True, False):
                        mine, theirs = _own_cpu(), _cpu_of(child.pid)
                        if shape == "Sync":
                            await _sync_round(target, frames, batch, messages)
                        else:
                            await _replicate_round(target, frames, messages)
                        cells.setdefault((shape, frames), []).append(
                            ((_own_cpu() - mine) / messages * 1e6,
                             (_cpu_of(child.pid) - theirs) / messages * 1e6))

        loop.run(measure())
    finally:
        child.kill()
        child.join()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "transport.md"
    path.write_text(_render(cells, messages, rounds, len(batch)), encoding="utf-8")
    return path


def _render(cells: dict[tuple[str, bool], list[tuple[float, float]]], messages: int,
            rounds: int, batch_bytes: int) -> str:
    def median(shape: str, frames: bool, end: int) -> float:
        return statistics.median(c[end] for c in cells[(shape, frames)])

    made = provenance()
    lines = [
        "# CPU per message: Cortex frames against gRPC (`cortex bench transport`)", "",
        f"`cortex bench transport --messages {messages} --rounds {rounds}` — "
        f"{made['generated']}, commit {made['commit']}, {made['machine']}, {cpu_model()}, "
        f"event loop {choose_loop().name}.",
        "",
        (__doc__ or "").split("\n\n", 1)[1].strip(), "",
        f"Messages: an `UpdateBatch` of {STORES} stores ({batch_bytes:,} bytes) answered by a "
        f"`SyncReply` (*Sync*: the client sends, the server replies); the same bytes as "
        f"`ReplicaBatch`es, server to client, paced (*Replicate*). {messages:,} messages "
        f"per round, {rounds} rounds per cell, µs of CPU per message (a Sync message is a "
        "batch and its reply), median of rounds.", "",
        "| stream | end | gRPC µs | frames µs | frames / gRPC |",
        "|---|---|---:|---:|---:|",
    ]
    for shape, ends in (("Sync", ("client (ingest)", "server (index)")),
                        ("Replicate", ("client (gateway)", "server (index)"))):
        for end, name in enumerate(ends):
            grpc, frames = median(shape, False, end), median(shape, True, end)
            ratio = f"{frames / grpc:.2f}" if grpc else "—"  # /proc counts 10 ms ticks
            lines.append(f"| {shape} | {name} | {grpc:.1f} | {frames:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def _parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--out", default="docs/bench", metavar="DIR",
                        help="report directory (default docs/bench)")
    parser.add_argument("--messages", type=int, default=3000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per cell")
    parser.set_defaults(func=lambda args: print(run(Path(args.out), args.messages,
                                                    args.rounds)) or 0)
    return parser


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``transport`` to ``cortex bench``."""
    _parser(bench_subparsers.add_parser(
        "transport", help="CPU per message of the index's streams: frames against gRPC",
        description="CPU per message at both ends of Sync- and Replicate-shaped streams, "
                    "over Cortex frames and over gRPC (HTTP/2)."))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser(argparse.ArgumentParser(prog="python -m cortex.bench.transport")
                   ).parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

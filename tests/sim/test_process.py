"""``cortex sim`` as a real process: command line, clean SIGTERM, crash and restart."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import urllib.request

import pytest
import zmq
import zmq.asyncio

from cortex.kvevents.codec import AllBlocksCleared, decode_batch
from cortex.kvevents.frames import ReplayEnd, parse_replay_reply, replay_request
from cortex.sim import cli
from cortex.sim.process import SimProcess
from cortex.testing import free_port


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["sim", *argv])


def test_command_line_builds_a_validated_config() -> None:
    config = cli.build_config(parse("--engine", "vllm", "--engine-version", "v0.33",
                                    "--zero-cost", "--output-tokens", "4:8", "--drop-batches",
                                    "2"))
    assert config.engine_version == "0.33.0" and config.port == 8000
    assert config.timing.zero_cost and config.output_tokens == (4, 8)
    assert config.faults.drop_batches == 2 and config.replay_port is None
    assert config.faults.fault_paths == "generation" and config.dp_size == 1
    scoped = cli.build_config(parse("--engine", "sglang", "--fault-paths", "all", "--dp-size",
                                    "4"))
    assert scoped.faults.fault_paths == "all" and scoped.dp_size == 4
    with pytest.raises(ValueError, match="dp_size"):
        cli.build_config(parse("--engine", "sglang", "--dp-size", "0"))
    with pytest.raises(ValueError, match="supported"):
        cli.build_config(parse("--engine", "vllm", "--engine-version", "0.99.0"))
    with pytest.raises(ValueError, match="bootstrap_port"):
        cli.build_config(parse("--engine", "vllm", "--bootstrap-port", "9000"))
    assert cli.run(parse("--engine", "sglang", "--block-size", "0")) == 2


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # SO_REUSEADDR: a closed connection's TIME_WAIT is not a listener left behind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_sigterm_stops_cleanly_and_frees_every_port() -> None:
    with SimProcess("--engine", "sglang", "--role", "prefill", "--port", "0",
                    "--kv-events-port", "0", "--replay-port", "0", "--bootstrap-port", "0",
                    "--zero-cost", "--dp-size", "2") as sim:
        # rank r publishes on kv_events_port + r and replays on replay_port + r
        ports = [sim.port, sim.info["kv_events_port"], sim.info["kv_events_port"] + 1,
                 sim.info["replay_port"], sim.info["replay_port"] + 1,
                 sim.info["bootstrap_port"], sim.info["transfer_port"]]
        assert sim.info["dp_size"] == 2
        assert not any(port_is_free(port) for port in ports)
        with urllib.request.urlopen(sim.url + "/health", timeout=5) as resp:
            assert resp.status == 200
        assert sim.stop() == 0
    assert all(port_is_free(port) for port in ports)


async def replay_from_zero(endpoint: str) -> list[tuple[int, object]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart(replay_request(0))
        out: list[tuple[int, object]] = []
        while True:
            reply = parse_replay_reply(await asyncio.wait_for(sock.recv_multipart(), 10))
            if isinstance(reply, ReplayEnd):
                return out
            out.append((reply.seq, decode_batch(reply.payload, "sglang").events))
    finally:
        sock.close(linger=0)
        ctx.term()


def chat(url: str, text: str) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    req = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_a_crashed_worker_restarts_with_seq_zero_and_a_clear() -> None:
    ports = [str(free_port()) for _ in range(3)]
    args = ("--engine", "sglang", "--port", ports[0], "--kv-events-port", ports[1],
            "--replay-port", ports[2], "--block-size", "4", "--zero-cost")
    with SimProcess(*args) as sim:
        for i in range(3):
            chat(sim.url, f"Message {i} to fill the cache with a few blocks.")
        before = asyncio.run(replay_from_zero(sim.replay_endpoint or ""))
        assert [seq for seq, _ in before] == list(range(len(before))) and len(before) >= 4
        sim.kill()
    with SimProcess(*args) as sim:  # same ports: subscribers reconnect on their own
        after = asyncio.run(replay_from_zero(sim.replay_endpoint or ""))
        assert [seq for seq, _ in after] == [0]
        assert after[0][1] == (AllBlocksCleared(),)

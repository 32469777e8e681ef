"""Discovery and ``cortex serve`` against real vLLM engines: what the engine says about itself
(``/kv_event_sources``, ``/v1/models``, ``/metrics`` ``cache_config_info``, ``/load``) read
by Cortex's own parsers, and the README's quickstart line ready soon after the engines."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cortex.hashing import Engine
from cortex.registry import discover
from cortex.registry.engines import parse_vllm_load, parse_vllm_metrics, vllm_work_from_metrics
from cortex.testing import wait_until
from cortex.testing.vllm_engines import BLOCK_SIZE, MAX_MODEL_LEN, TOPIC, VllmEngine, VllmInstall

from .conftest import model_dir
from .workload import post, report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(600)]


def test_discovery_learns_every_field_from_a_real_engine(engines: list[VllmEngine]) -> None:
    engine = engines[0]
    found = asyncio.run(discover(engine.url))
    assert found.problems == ()
    spec = found.spec()
    assert (spec.engine, spec.model, spec.block_size, spec.dp_size, spec.context_length,
            spec.topic) == (Engine.VLLM, "tiny-qwen", BLOCK_SIZE, 1, MAX_MODEL_LEN, TOPIC)
    # the engine says tcp://*:PORT (its bind address): learned at the URL's host
    assert spec.kv_events == f"tcp://127.0.0.1:{engine.events_port}"
    assert spec.replay == f"tcp://127.0.0.1:{engine.replay_port}"
    assert found.sources["kv_events"].endswith(f"bound as tcp://*:{engine.events_port}")
    assert spec.labels["hash_algo"] == "sha256"


def test_load_and_metrics_read_from_a_real_engine(engines: list[VllmEngine]) -> None:
    engine = engines[0]
    status, body = engine.call("/metrics")
    assert status == 200
    said = parse_vllm_metrics(body.decode())
    assert (said.learned, said.problem) == ({"block_size": BLOCK_SIZE, "hash_algo": "sha256"},
                                            None)
    assert said.load == (0, 0)  # what the gateway polls
    assert parse_vllm_load(json.loads(engine.call("/load")[1])) == 0
    long = {"model": engine.served_name, "prompt": "load " * 50, "max_tokens": 400,
            "ignore_eos": True}
    running = threading.Thread(target=engine.call, args=("/v1/completions", long))
    running.start()
    try:
        wait_until(lambda: parse_vllm_load(json.loads(engine.call("/load")[1])) == 1,
                   timeout=30, interval=0.02, what="/load to count the request in flight")
    finally:
        running.join(120)


def test_the_work_mark_moves_while_a_non_streamed_answer_is_generated(
    engines: list[VllmEngine],
) -> None:
    """What the gateway's wedge watch relies on (``dispatch/attempt.py``): a real engine's
    ``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total`` advance step by step
    while a non-streamed answer (no byte until it ends) is generated, not when it ends."""
    engine = engines[0]

    def mark() -> tuple[float, ...] | None:
        return vllm_work_from_metrics(engine.call("/metrics")[1].decode())

    before = mark()
    assert before is not None
    long = {"model": engine.served_name, "prompt": "count " * 20, "max_tokens": 3000,
            "ignore_eos": True}
    done = threading.Event()

    def generate() -> None:
        engine.call("/v1/completions", long, timeout_s=300)
        done.set()

    running = threading.Thread(target=generate)
    running.start()
    seen: list[tuple[float, ...] | None] = [before]

    def moved() -> bool:
        now = mark()
        if now != seen[-1]:
            seen.append(now)
        return len(seen) >= 4 or done.is_set()

    try:
        wait_until(moved, timeout=120, interval=0.05, what="the counters to move thrice")
        assert not done.is_set(), f"the answer ended before the mark moved thrice: {seen}"
    finally:
        running.join(300)
    final = mark()
    assert final is not None and final[0] >= before[0] + 3000


def test_cortex_serve_is_ready_soon_after_the_engines(
    engines: list[VllmEngine], install: VllmInstall, tmp_path: Path,
) -> None:
    """The README's quickstart line; ready = the state file is written (the gateway serves
    both workers, their ledgers READY). The time is reported, not asserted."""
    state_file = tmp_path / "state.json"
    argv = [sys.executable, "-m", "cortex.edge.main", "serve", "--port", "0",
            "--worker-urls", *[e.url for e in engines],
            "--tokenizer-path", str(model_dir(install)),
            "--log-dir", str(tmp_path / "logs"), "--state-file", str(state_file)]
    started = time.monotonic()
    with open(tmp_path / "serve.out", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: state_file.exists() or proc.poll() is not None, timeout=120,
                   interval=0.05, what="cortex serve to be ready")
        ready_s = time.monotonic() - started
        printed = (tmp_path / "serve.out").read_text()
        assert proc.poll() is None, printed
        state = json.loads(state_file.read_text())
        assert "problem" not in printed and "routed by load only" not in printed, printed
        assert sorted(w["kv_events"] for w in state["workers"]) == sorted(
            f"tcp://127.0.0.1:{e.events_port}" for e in engines)
        gateway = state["gateways"][0]["url"]
        body = {"model": "tiny-qwen", "max_tokens": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": "serve " * 200}]}
        first, second = post(gateway + "/v1/chat/completions", body), \
            post(gateway + "/v1/chat/completions", body)
        assert first[0] == second[0] == 200
        cached = json.loads(second[2])["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(second[1]["x-cortex-cache-hit-tokens"]) == cached > 0
        report("serve_ready", {"ready_s": round(ready_s, 2),
                               "engine_startup_s": [e.startup_s for e in engines]})
    finally:
        proc.terminate()
        assert proc.wait(30) == 0

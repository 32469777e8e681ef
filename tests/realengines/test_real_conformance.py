"""The simulator against the engine it models: ``cortex sim --engine vllm`` and a real vLLM
0.32 engine are asked the same questions, and every difference in the *shape* of what Cortex
reads fails (docs/sim.md, "How the sim is checked").

What Cortex reads, per answer: discovery's endpoints (``/kv_event_sources``, ``/v1/models``,
the ``vllm:cache_config_info`` labels), the load it polls (``/load``, the
``vllm:num_requests_*`` gauges), ``/tokenize`` (the gateway answers in the engine's shape),
the usage of completions (``prompt_tokens_details.cached_tokens``, the truth of every
prediction), the SSE framing of streams, error bodies (relayed to clients), and the ZMQ
frames of the KV events (ingest decodes them). Differences elsewhere are printed, not failed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from cortex.gateway.fleet.load import VLLM_LOAD_PATH, VLLM_LOAD_SAMPLES
from cortex.hashing import Engine
from cortex.kvevents.codec import decode_batch, encode_batch
from cortex.registry.engines import (
    kv_device_blocks_from_vllm_metrics,
    parse_vllm_metrics,
    vllm_work_from_metrics,
)
from cortex.sim.process import SimProcess
from cortex.testing.vllm_engines import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    TOPIC,
    VllmEngine,
    VllmInstall,
)

from .conftest import model_dir
from .shapes import differences, shape
from .workload import report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(300)]

ENGINE_VERSION = "0.32.0"
_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)


class Asked:
    """One server (engine or sim) and how to reach it."""

    def __init__(self, url: str, events: str) -> None:
        self.url, self.events = url, events

    def call(self, path: str, body: Any = None, raw: bytes | None = None
             ) -> tuple[int, bytes]:
        import urllib.error
        import urllib.request

        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={
            "Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()


@pytest.fixture(scope="module")
def engine(engines: list[VllmEngine]) -> Asked:
    first = engines[0]
    return Asked(first.url, f"tcp://127.0.0.1:{first.events_port}")


@pytest.fixture(scope="module")
def sim(install: VllmInstall, engine: Asked) -> Iterator[Asked]:
    """The sim configured as the engine is (its KV pool: the engine's ``num_gpu_blocks``)."""
    directory = model_dir(install)
    labels = dict(re.findall(r'([A-Za-z_]+)="([^"]*)"', _INFO.search(
        engine.call("/metrics")[1].decode())[1]))  # type: ignore[index]
    blocks = labels["num_gpu_blocks"]
    with SimProcess("--engine", "vllm", "--engine-version", ENGINE_VERSION,
                    "--model", "tiny-qwen", "--tokenizer", str(directory),
                    "--chat-template", str(directory / "chat_template.jinja"),
                    "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
                    "--kv-capacity-blocks", blocks, "--topic", TOPIC, "--zero-cost",
                    "--port", "0", "--kv-events-port", "0", "--replay-port", "0") as process:
        yield Asked(process.url, process.kv_events_endpoint)


def _chat(text: str, **more: Any) -> dict[str, Any]:
    return {"model": "tiny-qwen", "messages": [{"role": "user", "content": text}],
            "max_tokens": 3, "ignore_eos": True, **more}


USAGE = ("usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens",
         "usage.prompt_tokens_details.cached_tokens")
"""What the gateway reads of a usage (``cached_tokens``: the truth of every prediction)."""

QUESTIONS: list[tuple[str, str, Any, tuple[str, ...]]] = [
    # (name, path, body (None: GET), the paths Cortex reads ("" = all of it))
    ("kv_event_sources", "/kv_event_sources", None, ("",)),
    ("models", "/v1/models", None, ("object", "data[].id", "data[].root", "data[].parent",
                                    "data[].max_model_len", "data[].owned_by")),
    ("load", "/load", None, ("",)),
    ("tokenize_chat", "/tokenize", {"model": "tiny-qwen", "add_generation_prompt": True,
                                    "messages": [{"role": "user", "content": "hello there"}]},
     ("",)),
    ("tokenize_prompt", "/tokenize", {"model": "tiny-qwen", "prompt": "hello there"}, ("",)),
    ("chat", "/v1/chat/completions", _chat("hello there"),
     ("id", "object", "model", *USAGE, "choices[].message.role",
      "choices[].message.content", "choices[].finish_reason", "choices[].index")),
    ("completion", "/v1/completions", {"model": "tiny-qwen", "prompt": "hello there",
                                       "max_tokens": 3, "ignore_eos": True},
     ("id", "object", "model", *USAGE, "choices[].text", "choices[].finish_reason")),
    ("error_unknown_model", "/v1/chat/completions", {**_chat("x"), "model": "nope"}, ("",)),
    ("error_too_long", "/v1/chat/completions", _chat("x", max_tokens=MAX_MODEL_LEN * 2),
     ("",)),
]


def _read(differences_found: list[str], reads: tuple[str, ...]) -> list[str]:
    """The differences at or under a path of ``reads`` (``""``: every difference)."""
    return [d for d in differences_found for path in [d.split(":", 1)[0]]
            if any(r == "" or path == r or path.startswith((r + ".", r + "[]")) for r in reads)]


@pytest.mark.parametrize(("name", "path", "body", "reads"), QUESTIONS,
                         ids=[q[0] for q in QUESTIONS])
def test_the_sim_answers_in_the_engines_shape(engine: Asked, sim: Asked, name: str, path: str,
                                              body: Any, reads: tuple[str, ...]) -> None:
    (engine_status, engine_raw), (sim_status, sim_raw) = engine.call(path, body), \
        sim.call(path, body)
    theirs, ours = json.loads(engine_raw), json.loads(sim_raw)
    found = differences(shape(theirs), shape(ours))
    report(f"conformance_{name}", {"status": [engine_status, sim_status], "differences": found,
                                   "engine": theirs if len(engine_raw) < 2000 else "…"})
    assert sim_status == engine_status, (engine_raw[:300], sim_raw[:300])
    assert _read(found, reads) == [], found


def test_bad_json_is_answered_alike(engine: Asked, sim: Asked) -> None:
    answers = [a.call("/v1/chat/completions", raw=b"not json") for a in (engine, sim)]
    (engine_status, engine_raw), (sim_status, sim_raw) = answers
    found = differences(shape(json.loads(engine_raw)), shape(json.loads(sim_raw)))
    report("conformance_bad_json", {"status": [engine_status, sim_status], "differences": found})
    assert (sim_status, found) == (engine_status, [])


def _sse(raw: bytes) -> tuple[list[str], list[Any]]:
    """The framing (each event's prefix) and the chunks of an SSE body."""
    events = [e for e in raw.decode().split("\n\n") if e]
    frames = ["[DONE]" if e == "data: [DONE]" else e.split(" ", 1)[0] for e in events]
    chunks = [json.loads(e[len("data: "):]) for e in events if e != "data: [DONE]"]
    return frames, chunks


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streams_are_framed_alike(engine: Asked, sim: Asked, path: str) -> None:
    body: dict[str, Any] = (_chat("hello there") if "chat" in path else
                            {"model": "tiny-qwen", "prompt": "hello there", "max_tokens": 3,
                             "ignore_eos": True})
    body.update(stream=True, stream_options={"include_usage": True})
    (theirs, their_chunks), (ours, our_chunks) = (_sse(engine.call(path, body)[1]),
                                                  _sse(sim.call(path, body)[1]))
    assert ours == theirs  # "data:" events, then "data: [DONE]"
    usage = [differences(shape(t), shape(o)) for t, o in zip(
        [c for c in their_chunks if c.get("usage")], [c for c in our_chunks if c.get("usage")],
        strict=True)]
    content = differences(shape(their_chunks[1]), shape(our_chunks[1]))
    report(f"conformance_stream{path.replace('/', '_')}", {"usage": usage, "chunk": content})
    assert len(usage) == 1 and _read(usage[0], USAGE) == []
    assert _read(content, ("choices[].delta.content", "choices[].text", "choices[].index",
                           "object", "id")) == []


def _labels(text: str) -> set[str]:
    found = _INFO.search(text)
    assert found, "no vllm:cache_config_info"
    return {pair.split("=", 1)[0] for pair in re.findall(r'[A-Za-z_]+="[^"]*"', found[1])}


def test_metrics_carry_the_gauges_cortex_reads(engine: Asked, sim: Asked) -> None:
    theirs, ours = engine.call("/metrics")[1].decode(), sim.call("/metrics")[1].decode()
    read = {"block_size", "enable_prefix_caching", "prefix_caching_hash_algo", "num_gpu_blocks"}
    report("conformance_metrics", {"engine_only": sorted(_labels(theirs) - _labels(ours)),
                                   "sim_only": sorted(_labels(ours) - _labels(theirs))})
    assert read <= _labels(theirs) and read <= _labels(ours)
    for gauge in ("vllm:num_requests_running{", "vllm:num_requests_waiting{"):
        assert gauge in theirs and gauge in ours


def _sample_names(text: str) -> set[str]:
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_filtered_by_name_answer_the_load_polls_samples_alone(
        engine: Asked, sim: Asked) -> None:
    """The gateway's vLLM load poll asks ``/metrics/?name[]=…`` (prometheus_client's app
    mounted beside the ``/metrics`` route, which ignores the filter)."""
    query = VLLM_LOAD_PATH.partition("?")[2]
    for asked in (engine, sim):
        whole = asked.call("/metrics")[1].decode()
        status, body = asked.call(VLLM_LOAD_PATH)
        text = body.decode()
        assert status == 200
        assert _sample_names(text) == set(VLLM_LOAD_SAMPLES) <= _sample_names(whole)
        assert parse_vllm_metrics(text).load is not None
        assert kv_device_blocks_from_vllm_metrics(text) == kv_device_blocks_from_vllm_metrics(
            whole)
        assert vllm_work_from_metrics(text) is not None
        ignored = asked.call("/metrics?" + query)[1].decode()  # the route, not the mount
        assert _sample_names(ignored) == _sample_names(whole)
    report("conformance_metrics_by_name", {"whole_bytes": len(engine.call("/metrics")[1]),
                                           "by_name_bytes": len(engine.call(
                                               VLLM_LOAD_PATH)[1])})


def _first_stored(asked: Asked) -> list[bytes]:
    """Subscribe, send a prompt nobody sent before, return the first frames that store it."""
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(asked.events)
    try:
        marker = uuid.uuid4().hex
        for _ in range(50):  # a slow joiner misses what is published before it is connected
            asked.call("/v1/completions", {"model": "tiny-qwen", "max_tokens": 1,
                                           "prompt": f"{marker} " * 40})
            try:
                while True:
                    frames = sub.recv_multipart()
                    batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                    if any(isinstance(e, dict) and e.get("type") == "BlockStored"
                           for e in batch[1]):
                        return list(frames)
            except zmq.Again:
                marker = uuid.uuid4().hex
        raise AssertionError(f"no BlockStored from {asked.events}")
    finally:
        sub.close(linger=0)


def test_kv_event_frames_are_alike(engine: Asked, sim: Asked) -> None:
    theirs, ours = _first_stored(engine), _first_stored(sim)
    assert len(ours) == len(theirs) == 3  # topic, seq, payload
    assert ours[0] == theirs[0] == TOPIC.encode() and len(ours[1]) == len(theirs[1]) == 8
    their_batch, our_batch = (msgpack.unpackb(f[2], raw=False, strict_map_key=False)
                              for f in (theirs, ours))
    found = differences(shape(their_batch), shape(our_batch))
    report("conformance_zmq", {"differences": found, "engine_batch_head": repr(their_batch)[:300]})
    assert found == []
    # and byte for byte: the engine's payload re-encoded as the sim encodes 0.32
    decoded = decode_batch(theirs[2], Engine.VLLM)
    assert encode_batch(decoded, Engine.VLLM, ENGINE_VERSION) == theirs[2]

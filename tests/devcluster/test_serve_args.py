"""``cortex serve``'s command line → workers and gateway config sections (pure)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from cortex.devcluster.serve import (
    WORKER_KEY_ENV,
    WorkerArg,
    describe,
    gateway_sections,
    with_worker_key,
    worker_args,
)
from cortex.edge.main import build_parser
from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.http.auth import hash_key
from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.testing import free_port

pytestmark = pytest.mark.timeout(10)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(["serve"]).parse_args(["serve", *argv])


def spec(url: str, model: str = "m", engine: Engine = Engine.SGLANG, block: int = 16,
         **extra: Any) -> WorkerSpec:
    return WorkerSpec(id=url.rsplit(":", 1)[1], url=url, engine=engine, model=model,
                      block_size=block, **extra)


def test_sglang_router_style_workers() -> None:
    args = parse("--worker-urls", "http://a:1", "http://b:2", "--pd-disaggregation",
                 "--prefill", "http://p:3", "9001", "--prefill", "http://q:4", "none",
                 "--decode", "http://d:5", "--decode", "http://e:6")
    assert worker_args(args) == [
        WorkerArg("http://a:1"), WorkerArg("http://b:2"),
        WorkerArg("http://p:3", "prefill", 9001), WorkerArg("http://q:4", "prefill"),
        WorkerArg("http://d:5", "decode"), WorkerArg("http://e:6", "decode")]


@pytest.mark.parametrize(("argv", "message"), [
    ((), "no workers"),
    (("--prefill", "http://p:3", "x"), r"URL \[BOOTSTRAP_PORT\|none\]"),
    (("--worker-urls", "http://a:1", "http://a:1/"), "given twice"),
])
def test_bad_worker_lists(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker_args(parse(*argv))


def test_sections_one_model_entry_per_model_with_the_routers_knobs(tmp_path: Any) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    args = parse("--worker-urls", "http://a:1", "--max-concurrent-requests", "-1",
                 "--queue-size", "8", "--request-timeout-secs", "1800",
                 "--tokenizer-path", str(tokenizer))
    sections = gateway_sections([spec("http://a:1"), spec("http://b:2"),
                                 spec("http://c:3", "other", Engine.VLLM, 32)], args)
    assert sections["models"] == [
        {"name": "m", "engine": "sglang", "block_size": 16, "tokenizer": str(tokenizer)},
        {"name": "other", "engine": "vllm", "block_size": 32, "tokenizer": str(tokenizer)}]
    assert sections["admission"] == {"max_concurrent_requests": 0, "queue_size": 8}
    assert sections["upstream"] == {"request_timeout_s": 1800.0}
    assert sections["server"]["read_timeout_s"] > 1800
    GatewayConfig.from_mapping(sections)  # the gateway accepts what serve writes


def test_workers_of_one_model_must_share_its_hash_domain() -> None:
    with pytest.raises(ValueError, match="disagree on engine / block size"):
        gateway_sections([spec("http://a:1"), spec("http://b:2", block=32)],
                         parse("--worker-urls", "http://a:1"))


def test_api_key_becomes_a_key_digest_and_the_workers_credential() -> None:
    args = parse("--worker-urls", "http://a:1", "http://b:2", "--api-key", "sk-test")
    (key,) = gateway_sections([spec("http://a:1")], args)["auth"]["keys"]
    assert key == {"id": "serve", "hash": hash_key("sk-test")}
    assert "sk-test" not in repr(gateway_sections([spec("http://a:1")], args))
    own = dataclasses.replace(spec("http://b:2"), credential="file:/run/secrets/b")
    credentials = [s.credential for s in with_worker_key([spec("http://a:1"), own], args)]
    assert credentials == [f"env:{WORKER_KEY_ENV}", "file:/run/secrets/b"]
    assert with_worker_key([spec("http://a:1")], parse("--worker-urls", "http://a:1")) == [
        spec("http://a:1")]


def test_engine_and_block_size_are_defaults_for_workers_that_do_not_say_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    args = parse("--worker-urls", dead, "--engine", "vllm", "--model", "m", "--block-size", "8",
                 "--discovery-timeout", "1")
    (spec,) = describe(worker_args(args), args)
    assert (spec.engine, spec.model, spec.block_size, spec.kv_events) == (
        Engine.VLLM, "m", 8, None)
    assert "publishes no KV events" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"could not learn block_size .*\(--block-size\)"):
        describe(worker_args(args), parse("--worker-urls", dead, "--engine", "vllm",
                                          "--model", "m", "--discovery-timeout", "1"))

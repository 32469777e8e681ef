"""SGLang's own Rust gateway (``sglang-router`` from PyPI) cannot tell sims from SGLang."""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from cortex.sim.process import SimProcess
from cortex.testing import free_port, sglang_router_argv, wait_until

PROMPT = "You are a meticulous assistant. Explain how a lighthouse keeper spends a day. " * 4


def http(method: str, url: str, body: Any = None, timeout: float = 10) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with start_sims(("--engine", "sglang"), ("--engine", "sglang")) as procs:
        yield procs


@contextlib.contextmanager
def start_sims(*argvs: tuple[str, ...]) -> Iterator[list[SimProcess]]:
    """Sim processes started in parallel; stopped when the generator is closed."""
    with contextlib.ExitStack() as stack:
        procs = [SimProcess(*argv, "--port", "0", "--kv-events-port", "0", "--block-size", "16",
                            "--zero-cost", "--log-level", "warning") for argv in argvs]
        for proc in procs:
            stack.callback(proc.close)
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        yield procs


@contextlib.contextmanager
def router(policy: str, workers: list[SimProcess] | None = None, *, pd: list[str] | None = None
           ) -> Iterator[str]:
    port = free_port()
    argv = sglang_router_argv(port, policy, [w.url for w in workers or []], pd_args=pd)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            def ready() -> bool:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"sglang-router exited: {log.read()[-2000:]!r}")
                status, body = http("GET", url + "/v1/models", timeout=2)
                return status == 200 and b"cortex-sim" in body

            wait_until(ready, timeout=30, interval=0.1, what="sglang-router with its workers")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def finished(sim: SimProcess) -> int:
    _, body = http("GET", sim.url + "/sim/state")
    count: int = json.loads(body)["stats"]["requests_finished"]
    return count


def chat(url: str, text: str, **extra: Any) -> dict[str, Any]:
    status, body = http("POST", url + "/v1/chat/completions",
                        {"model": "cortex-sim", "messages": [{"role": "user", "content": text}],
                         "max_tokens": 4, **extra})
    assert status == 200, body
    out: dict[str, Any] = json.loads(body)
    return out


def test_round_robin_spreads_chat_requests(sims: list[SimProcess]) -> None:
    before = [finished(s) for s in sims]
    with router("round_robin", sims) as url:
        for i in range(4):
            out = chat(url, f"{PROMPT} question {i}")
            assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 4
        status, body = http("POST", url + "/v1/chat/completions",
                            {"model": "cortex-sim", "stream": True, "max_tokens": 3,
                             "messages": [{"role": "user", "content": "stream please"}]})
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    served = [finished(s) - b for s, b in zip(sims, before, strict=True)]
    assert sum(served) == 5 and min(served) >= 2


def test_cache_aware_sends_a_repeated_prompt_where_it_is_cached(sims: list[SimProcess]) -> None:
    before = [finished(s) for s in sims]
    with router("cache_aware", sims) as url:
        outs = [chat(url, "A different opening. " + PROMPT) for _ in range(3)]
    served = [finished(s) - b for s, b in zip(sims, before, strict=True)]
    assert sorted(served) == [0, 3]
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and cached[1] == cached[2] > 0


def test_pd_disaggregation_through_the_router() -> None:
    with start_sims(("--engine", "sglang", "--role", "prefill", "--bootstrap-port", "0"),
                    ("--engine", "sglang", "--role", "decode")) as (prefill, decode):
        pd = ["--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port),
              "--decode", decode.url]
        with router("cache_aware", pd=pd) as url:
            outs = [chat(url, "Disaggregated: " + PROMPT) for _ in range(2)]
            status, body = http("POST", url + "/generate",
                                {"text": "native generate", "sampling_params":
                                 {"max_new_tokens": 3}})
            assert status == 200 and len(json.loads(body)["output_ids"]) == 3
        assert [o["usage"]["completion_tokens"] for o in outs] == [4, 4]
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        assert cached[0] == 0 and cached[1] > 0  # the decode reports the prefill's hit
        assert finished(prefill) == finished(decode) == 3

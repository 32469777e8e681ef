"""Can a real prefill/decode pair run on this CPU? vLLM's example connector
(``ExampleConnector``: the prefill writes each request's KV blocks as safetensors files
under a shared path, the decode loads them when it finds the prompt's files) is the one KV
connector with no GPU, RDMA or external service behind it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cortex.testing.vllm_engines import VllmEngine, VllmInstall

from .conftest import start_engines
from .workload import report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(600)]


def _connector(role: str, storage: Path) -> tuple[str, ...]:
    return ("--kv-transfer-config", json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)}}))


def test_a_prefill_decode_pair_through_the_example_connector(
    install: VllmInstall, tmp_path: Path,
) -> None:
    storage = tmp_path / "kv"
    prefill = VllmEngine(install, tmp_path, extra_args=_connector("kv_producer", storage))
    decode = VllmEngine(install, tmp_path, extra_args=_connector("kv_consumer", storage))
    try:
        start_engines([prefill, decode])
        prompt = {"model": prefill.served_name, "prompt": "pd " * 300, "max_tokens": 1,
                  "ignore_eos": True}
        status, _ = prefill.call("/v1/completions", prompt)
        assert status == 200
        written = sorted(p.name for p in storage.rglob("*.safetensors"))
        status, raw = decode.call("/v1/completions", {**prompt, "max_tokens": 8})
        assert status == 200, raw[:300]
        usage = json.loads(raw)["usage"]
        report("pd_example_connector", {"files_written": len(written), "decode_usage": usage})
        assert written, "the prefill wrote no KV files"
        # the decode never saw the prompt: what it reports as cached came from the files
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    finally:
        for engine in (prefill, decode):
            engine.stop()

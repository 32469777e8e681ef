"""``/v1/messages`` and stateless ``/v1/responses`` against a REAL vLLM 0.32: token ids.

For the agent corpus of ``tests/chat/agent_requests`` (300 Messages and 240 Responses
bodies with the tiny engine's model name), Cortex's ids (``messages_render_args`` /
``responses_render_args`` with the Qwen3.5 template the engine serves) are compared with:

- the engine's ``/v1/messages/count_tokens`` (its own conversion and rendering): the count;
- the engine's ``/tokenize`` of the chat request vLLM's own conversion code makes of the body
  (``tools/realengines/agent_reference.py``, run with the engine's interpreter): the ids;
- a sample sent for real (``max_tokens`` 1): the prompt tokens its usage reports.

Then through the gateway in front of both engines: a Messages request sent twice lands on the
same worker the second time, ``exact_kv``, crediting no more than the engine reports cached.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import ChatError, ChatTokenizer
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.messages_api import messages_options, messages_render_args
from cortex.chat.responses_api import responses_render_args
from cortex.devcluster.cluster import LocalCluster
from cortex.hashing import Engine
from cortex.testing.vllm_engines import VllmEngine, VllmInstall

from ..chat.agent_requests import messages_corpus, responses_corpus
from .conftest import model_dir
from .workload import post, report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(900)]

ROOT = Path(__file__).parents[2]


def _tokenizer(install: VllmInstall) -> ChatTokenizer:
    directory = model_dir(install)
    return ChatTokenizer.load(str(directory), str(directory / "chat_template.jinja"))


def _named(bodies: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    return [{**body, "model": model} for body in bodies]


def _reference(install: VllmInstall, job: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own conversion of the bodies (its interpreter, its code)."""
    done = subprocess.run([str(install.python), str(ROOT / "tools/realengines/agent_reference.py")],
                          input=json.dumps(job), capture_output=True, text=True, check=True,
                          timeout=600)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _validated(message: dict[str, Any]) -> dict[str, Any]:
    """A Responses chat message as the chat request models validate it: without the item's
    ``type``, ``input_text`` parts as ``text`` parts (vLLM parses both the same way)."""
    out = {k: v for k, v in message.items() if k != "type"}
    if isinstance(out.get("content"), list):
        out["content"] = [{**p, "type": "text"} if p.get("type") == "input_text" else p
                          for p in out["content"]]
    return out


def _tokenize_body(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat request as ``/tokenize`` takes it: a request-level ``reasoning_effort`` (which
    ``/tokenize`` drops) moved into the template variables, as chat completions merge it."""
    body = {"model": model, **chat, "messages": [_validated(m) for m in chat["messages"]]}
    effort = body.pop("reasoning_effort", None)
    if effort is not None:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
        body["chat_template_kwargs"] = kwargs
    return body


def _servable(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as this engine serves it: it runs without ``--enable-auto-tool-choice`` or a
    tool parser, so a request with tools says ``tool_choice: none`` (vLLM renders the tools
    all the same) and one without tools says none."""
    out = {k: v for k, v in body.items() if k != "tool_choice"}
    return {**out, "tool_choice": {"type": "none"}} if body.get("tools") else out


def _ours(make: Any) -> list[int] | None:
    try:
        ids: list[int] = make()
    except (ChatError, UnmodelledRequest):
        return None
    return ids


def test_messages_ids_equal_the_engines(install: VllmInstall, engines: list[VllmEngine]
                                        ) -> None:
    engine = engines[0]
    chat = _tokenizer(install)
    options = messages_options(chat, Engine.VLLM)
    bodies = [_servable(b) for b in _named(messages_corpus(), engine.served_name)]
    ref = _reference(install, {"messages": bodies,
                               "merge_inline_system": options.merge_inline_system,
                               "disabled_thinking_effort": options.disabled_thinking_effort})
    counted = id_compared = count_mismatches = id_mismatches = refused = 0
    for i, (body, theirs) in enumerate(zip(bodies, ref["messages"], strict=True)):
        ours = _ours(lambda b=body: chat.encode_chat(messages_render_args(b, Engine.VLLM,
                                                                          options)))
        if "error" in theirs:
            assert ours is None, (i, theirs["error"])
            refused += 1
            continue
        assert ours is not None, i
        status, _, raw = post(engine.url + "/v1/messages/count_tokens",
                              {k: v for k, v in body.items()
                               if k not in ("max_tokens", "stop_sequences")})
        assert status == 200, raw[:300]
        counted += 1
        count_mismatches += json.loads(raw)["input_tokens"] != len(ours)
        status, raw = engine.call("/tokenize", _tokenize_body(theirs, engine.served_name))
        if status != 200:  # the template refuses the converted chat: so must Cortex's
            raise AssertionError((i, raw[:300]))
        id_compared += 1
        id_mismatches += json.loads(raw)["tokens"] != ours
    report("agent_messages_vllm", {"bodies": len(bodies), "count_compared": counted,
                                   "count_mismatches": count_mismatches,
                                   "ids_compared": id_compared, "id_mismatches": id_mismatches,
                                   "refused_by_both": refused})
    assert count_mismatches == id_mismatches == 0
    assert id_compared >= 200


def test_responses_ids_equal_the_engines(install: VllmInstall, engines: list[VllmEngine]
                                         ) -> None:
    engine = engines[0]
    chat = _tokenizer(install)
    bodies = _named(responses_corpus(), engine.served_name)
    ref = _reference(install, {"responses": bodies})
    compared = mismatches = refused = 0
    for i, (body, theirs) in enumerate(zip(bodies, ref["responses"], strict=True)):
        ours = _ours(lambda b=body: chat.encode_chat(responses_render_args(b, Engine.VLLM)))
        if "error" in theirs:
            assert ours is None, (i, theirs["error"])
            refused += 1
            continue
        status, raw = engine.call("/tokenize", _tokenize_body(theirs, engine.served_name))
        if status != 200:
            assert ours is None, (i, raw[:300])
            refused += 1
            continue
        assert ours is not None, i
        compared += 1
        mismatches += json.loads(raw)["tokens"] != ours
    report("agent_responses_vllm", {"bodies": len(bodies), "ids_compared": compared,
                                    "id_mismatches": mismatches, "refused_by_both": refused})
    assert mismatches == 0
    assert compared >= 200


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_the_engine_reports_the_prompt_tokens_cortex_computes(
        install: VllmInstall, engines: list[VllmEngine], api: str) -> None:
    engine = engines[0]
    chat = _tokenizer(install)
    options = messages_options(chat, Engine.VLLM)
    checked = 0
    if api == "messages":
        bodies = _named(messages_corpus(30, seed=7), engine.served_name)
    else:
        bodies = _named(responses_corpus(30, seed=7), engine.served_name)
    for body in bodies:
        if api == "messages":
            body = _servable({**body, "max_tokens": 1})
            body.pop("thinking", None)
            ours = _ours(lambda b=body: chat.encode_chat(messages_render_args(
                b, Engine.VLLM, options)))
        else:
            body = {**body, "max_output_tokens": 1}
            ours = _ours(lambda b=body: chat.encode_chat(responses_render_args(b, Engine.VLLM)))
        if ours is None:
            continue
        status, _, raw = post(engine.url + f"/v1/{api}", body)
        assert status == 200, raw[:300]
        usage = json.loads(raw)["usage"]
        prompt = (usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
                  + (usage.get("cache_creation_input_tokens") or 0)
                  if api == "messages" else usage["input_tokens"])
        assert prompt == len(ours)
        checked += 1
    report(f"agent_{api}_usage_vllm", {"checked": checked})
    assert checked >= 20


def test_the_gateway_routes_messages_on_exact_kv(cluster: LocalCluster,
                                                 engines: list[VllmEngine]) -> None:
    body = _servable({**messages_corpus(1, seed=99)[0], "model": engines[0].served_name,
                      "max_tokens": 1})
    body.pop("thinking", None)
    url = cluster.gateway_urls[0] + "/v1/messages"
    status, first, raw = post(url, body)
    assert status == 200, raw[:300]
    worker = first["x-cortex-assigned-worker"]
    seen = []
    for _ in range(20):  # the engine's KV events reach the ledger within moments
        status, headers, raw = post(url, body)
        assert status == 200
        usage = json.loads(raw)["usage"]
        cached = usage.get("cache_read_input_tokens") or 0
        hit = int(headers["x-cortex-cache-hit-tokens"])
        assert hit <= cached  # never credited more than the engine reports
        seen.append((headers["x-cortex-match-mode"], headers["x-cortex-assigned-worker"], hit,
                     cached))
        if headers["x-cortex-match-mode"] == "exact_kv" and hit == cached:
            break
    mode, assigned, hit, cached = seen[-1]
    report("agent_gateway_vllm", {"attempts": len(seen), "hit": hit, "cached": cached})
    assert (mode, assigned) == ("exact_kv", worker), seen
    assert hit == cached > 0, seen

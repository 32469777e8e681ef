"""Write the engines' own conversions of the agent corpus as golden fixtures.

``tests/chat/data/agent_apis.json.gz`` holds, for the corpus of ``tests/chat/agent_requests``
(Messages and Responses bodies), the chat body each engine's own code converts every body
to (or its refusal), per chat template whose probes differ (Qwen3.5: inline system messages
merged; DeepSeek-V4: not): vLLM 0.32 through ``agent_reference.py`` (the real engines'
interpreter), SGLang 0.5.23 through ``sglang_agent_reference.py`` (its wheel, see there).
``tests/chat/test_messages_api.py`` / ``test_responses_api.py`` then check Cortex's
conversion against them without either engine. Run from the project root::

    .venv/bin/python tools/realengines/agent_goldens.py /tmp/sgl /tmp/sgl-deps

SGLang's Responses conversion has its own fixture, ``tests/chat/data/sglang_responses.json.gz``
(``sglang_responses_corpus``: the Codex-style bodies and SGLang-specific shapes, converted by
``sglang_responses_reference.py`` in the project's venv; no vLLM needed)::

    .venv/bin/python tools/realengines/agent_goldens.py --sglang-responses /tmp/sgl /tmp/sgl-deps
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "chat"))

from agent_requests import (  # noqa: E402
    messages_corpus,
    responses_corpus,
    sglang_responses_corpus,
)

from cortex.chat import ChatTokenizer  # noqa: E402
from cortex.chat.messages_api import merges_inline_system  # noqa: E402
from cortex.hashing import Engine  # noqa: E402

OUT = ROOT / "tests" / "chat" / "data" / "agent_apis.json.gz"
SGLANG_RESPONSES = ROOT / "tests" / "chat" / "data" / "sglang_responses.json.gz"
TEMPLATES = {"qwen3.5": ROOT / "tests" / "chat" / "data" / "qwen3.5", "deepseek_v4": None}
VLLM_PY = Path(os.environ.get("CORTEX_REALVLLM", Path.home() / ".cache" / "realvllm")) \
    / "venv" / "bin" / "python"


def _run(args: list[str], job: dict[str, Any], env: dict[str, str] | None = None
         ) -> dict[str, Any]:
    done = subprocess.run(args, input=json.dumps(job), capture_output=True, text=True,
                          check=True, env={**os.environ, **(env or {})})
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def sglang_responses(sglang_wheel: str, sglang_deps: str) -> None:
    bodies = sglang_responses_corpus()
    templates = {name: ChatTokenizer.load(path).template.text for name, path in TEMPLATES.items()}
    converted = _run([sys.executable, str(ROOT / "tools/realengines/sglang_responses_reference.py"),
                      sglang_wheel], {"responses": bodies, "templates": templates},
                     {"PYTHONPATH": sglang_deps})
    with gzip.open(SGLANG_RESPONSES, "wt", encoding="utf-8") as f:
        json.dump({"engine": "sglang 0.5.23", "responses": bodies, "templates": converted}, f,
                  ensure_ascii=False, separators=(",", ":"))
    print(f"wrote {SGLANG_RESPONSES} ({SGLANG_RESPONSES.stat().st_size} bytes)")


def main() -> None:
    if sys.argv[1] == "--sglang-responses":
        sglang_responses(sys.argv[2], sys.argv[3])
        return
    sglang_wheel, sglang_deps = sys.argv[1], sys.argv[2]
    messages, responses = messages_corpus(), responses_corpus()
    golden: dict[str, Any] = {"messages": messages, "responses": responses, "templates": {}}
    for name, path in TEMPLATES.items():
        chat = ChatTokenizer.load(path)
        vllm_merge = merges_inline_system(chat.template.text, Engine.VLLM)
        sglang_merge = merges_inline_system(chat.template.text, Engine.SGLANG)
        # vLLM's thinking-disabled effort is probed at runtime; Cortex's probe of the same
        # template is checked in the test, the reference gets what the engine would find
        from cortex.chat.messages_api import messages_options
        disabled = messages_options(chat, Engine.VLLM).disabled_thinking_effort
        vllm = _run([str(VLLM_PY), str(ROOT / "tools/realengines/agent_reference.py")],
                    {"messages": messages, "responses": responses,
                     "merge_inline_system": vllm_merge, "disabled_thinking_effort": disabled})
        sglang = _run([str(VLLM_PY), str(ROOT / "tools/realengines/sglang_agent_reference.py"),
                       sglang_wheel], {"messages": messages,
                                       "merge_inline_system": sglang_merge},
                      {"PYTHONPATH": sglang_deps})
        golden["templates"][name] = {
            "vllm": {"merge_inline_system": vllm_merge, "disabled_thinking_effort": disabled,
                     **vllm},
            "sglang": {"merge_inline_system": sglang_merge, **sglang},
        }
    with gzip.open(OUT, "wt", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, separators=(",", ":"))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

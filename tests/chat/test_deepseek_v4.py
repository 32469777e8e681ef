"""``cortex.chat.deepseek_v4`` against prompts vLLM 0.32's ``deepseek_v4`` encoder wrote for
the same requests (``data/deepseek_v4_vllm.json``: thinking on, off and by default, reasoning
efforts, tools and DSML tool calls, tool results out of call order, list contents, reasoning
before and after the last user turn). The real engine's ``/tokenize`` checks the same in
``tests/realengines/test_real_tokenize.py``."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import ChatTokenizer, TemplateError, render_args
from cortex.chat.deepseek_v4 import (
    DEEPSEEK_V4_TEMPLATE,
    DeepSeekV4Template,
    render_deepseek_v4,
)
from cortex.hashing import Engine

CASES = json.loads((Path(__file__).parent / "data" / "deepseek_v4_vllm.json").read_text())["cases"]


@cache
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.load(chat_template=DEEPSEEK_V4_TEMPLATE)


def test_the_template_file_selects_the_encoder() -> None:
    assert isinstance(tokenizer().template, DeepSeekV4Template)
    assert not isinstance(ChatTokenizer.load().template, DeepSeekV4Template)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_renders_as_vllms_encoder(case: dict[str, Any]) -> None:
    args = render_args({"model": "m", **case["request"]}, Engine.VLLM)
    assert tokenizer().render(args) == case["prompt"]


def test_arguments_that_are_not_json_are_the_requests_fault() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(TemplateError, match="not JSON"):
        render_deepseek_v4(messages, None, {})

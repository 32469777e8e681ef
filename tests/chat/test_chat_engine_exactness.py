"""Prompt ids equal the engines' for two real tokenizers times both engine readings.

The reference is what each engine runs: ``transformers``' ``apply_chat_template`` (rendering)
and ``encode`` (tokenizing), assembled by the engine's own rules — vLLM tokenizes the whole
rendered text with the request's ``add_special_tokens``; SGLang removes a trailing assistant
message it continues, tokenizes the rendered rest without special tokens and appends
``encode(prefix)`` (special tokens on, a leading BOS dropped), and turns a trailing assistant
message it does not continue into a user message. Compared: ``cortex.chat`` (what the sim
serves, encoding with ``tokenizers``) and the gateway's segment-cached, chunked tokenizer
encoding with ``fastokens``, whose cache also holds the answers fed after earlier
conversations.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from cortex.chat import (
    ChatError,
    ChatTokenizer,
    EncoderChoice,
    default_tokenizer_dir,
    load_tokenizer,
    render_args,
)
from cortex.chat.template import DEFAULT_CHAT_TEMPLATE
from cortex.chat.tokenizer import special_tokens_map
from cortex.gateway.tokens.prompt import PromptTokenizer
from cortex.gateway.tokens.service import next_turn
from cortex.hashing import Engine

QWEN = Path(__file__).parent / "data" / "qwen3.5"
CONVERSATIONS = 240
WORDS = ["Hello", " world", " the", " quick", " brown", " fox", "\n", "\n\n", "  ", " ",
         "123456", " 42", "über", " café", "e\u0301", "日本語のテキスト", "中文", "😀", "<b>",
         "<", "don't", "'s", " 'S", "x=1;", "\t", "\r\n", "-", "...", " Ελληνικά", "ﬁ",
         "<think>", "</think>", "<|im_start|>", "<|im_end|>", "<\uff5cUser\uff5c>",
         "<tool_call>", "   indented", "END", "\u00a0", "Ⅻ"]
LONG = " ".join(["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "Adipiscing",
                 "elit", "sed", "do", "eiusmod"] * 14)  # > 512 chars: chunked pieces


@functools.cache
def tokenizers(name: str) -> tuple[ChatTokenizer, PreTrainedTokenizerFast]:
    if name == "qwen3.5":
        ours = ChatTokenizer.load(QWEN)
        template = (QWEN / "chat_template.jinja").read_text(encoding="utf-8")
        config = json.loads((QWEN / "tokenizer_config.json").read_text(encoding="utf-8"))
    else:
        ours = ChatTokenizer.load()
        template = DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")
        config = json.loads((default_tokenizer_dir() / "tokenizer_config.json").read_text(
            encoding="utf-8"))
    reference = PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(
        QWEN if name == "qwen3.5" else None), **special_tokens_map(config))
    reference.chat_template = template
    return ours, reference


@functools.cache
def fast(name: str) -> ChatTokenizer:
    return ChatTokenizer.load(QWEN if name == "qwen3.5" else None,
                              encoder=EncoderChoice.FASTOKENS)


def text(rng: random.Random) -> str:
    parts = [rng.choice(WORDS) for _ in range(rng.randint(0, 12))]
    if rng.random() < 0.15:
        parts.insert(rng.randint(0, len(parts)), LONG)
    return "".join(parts)


def body(rng: random.Random, engine: Engine, qwen: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng)})
    for turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": text(rng) or "q"})
        if turn or rng.random() < 0.7:
            messages.append({"role": "assistant", "content": text(rng)})
    if messages[-1]["role"] == "assistant" and rng.random() < 0.4:
        messages.pop()
    if messages[-1]["role"] == "assistant" and rng.random() < 0.5:
        messages[-1]["content"] = rng.choice(["\n\n", "\n", " ", ""]) + text(rng)
    out: dict[str, Any] = {"messages": messages}
    continued = messages[-1]["role"] == "assistant" and rng.random() < 0.7
    if continued:
        out["continue_final_message"] = True
        if engine is Engine.VLLM:
            out["add_generation_prompt"] = False
    if engine is Engine.VLLM and rng.random() < 0.3:
        out["add_special_tokens"] = True
    if qwen and rng.random() < 0.3:
        out["chat_template_kwargs"] = {"enable_thinking": False}
    return out


def reference_ids(reference: PreTrainedTokenizerFast, request: dict[str, Any],
                  engine: Engine) -> list[int]:
    messages = [dict(m) for m in request["messages"]]
    kwargs = dict(request.get("chat_template_kwargs") or {})
    if engine is Engine.VLLM:
        rendered = reference.apply_chat_template(
            messages, tokenize=False,
            add_generation_prompt=request.get("add_generation_prompt", True),
            continue_final_message=request.get("continue_final_message", False), **kwargs)
        ids: list[int] = reference.encode(rendered, add_special_tokens=request.get(
            "add_special_tokens", False))
        return ids
    prefix = ""
    if messages[-1]["role"] == "assistant":
        if request.get("continue_final_message"):
            prefix = messages.pop()["content"]
        else:
            messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    rendered = reference.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    ids = reference.encode(rendered, add_special_tokens=False)
    if prefix:
        extra = reference.encode(prefix)
        if extra and extra[0] == reference.bos_token_id:
            extra = extra[1:]
        ids += extra
    return ids


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
@pytest.mark.parametrize("name", ["qwen3.5", "deepseek-v4"])
def test_prompt_ids_equal_the_engines_over_random_conversations(name: str, engine: Engine
                                                                ) -> None:
    ours, reference = tokenizers(name)
    # the gateway encodes with fastokens (its probe passes for both), the sim with tokenizers
    gateway = PromptTokenizer(fast(name), cache_tokens=200_000, chunk_chars=64)
    assert gateway.segmented and gateway.chunk_chars == 64
    assert gateway.encoder.name == "fastokens" and ours.encoder is not None
    assert ours.encoder.name == "hf"
    rng = random.Random(f"{name}/{engine.value}")
    mismatches = []
    compared = 0
    for i in range(CONVERSATIONS):
        request = body(rng, engine, name == "qwen3.5")
        args = render_args(request, engine)
        try:
            expected = reference_ids(reference, request, engine)
        except ValueError:  # the template rejects it (e.g. a continued message it rewrites)
            with pytest.raises(ChatError):
                ours.encode_chat(args)
            continue
        got = (ours.encode_chat(args), gateway.encode_prompt(gateway.prompt(args)),
               gateway.encode_prompt(gateway.prompt(args)))  # the second time from the cache
        compared += 1
        if any(ids != expected for ids in got):
            mismatches.append((i, request))
        # the gateway then feeds an answer, as it does after a response
        answer = {"role": "assistant", "content": text(rng)}
        gateway.encode_prompt(gateway.prompt(next_turn(args, answer)))
    assert mismatches == []
    assert compared >= 200
    assert gateway.cache.stats.hits > 0


def test_sglang_continues_a_qwen_prefix_with_its_own_tokens() -> None:
    # The known divergence: the prefix "\n\n..." after "<think>\n" merges into one token
    # when the whole text is encoded (vLLM), not when SGLang encodes it on its own.
    ours, _ = tokenizers("qwen3.5")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nThe"}]
    sglang = ours.encode_chat(render_args({"messages": messages,
                                           "continue_final_message": True}, Engine.SGLANG))
    think = ours.tokenizer.token_to_id("<think>")
    assert sglang[-5:] == [198, think, 198, 271, 760]  # "\n", <think>, "\n", "\n\n", "The"
    whole = ours.encode(ours.render(render_args({"messages": messages,
                                                 "continue_final_message": True},
                                                Engine.SGLANG)), False)
    assert whole[-3:] == [think, 1358, 760]  # "\n\n\n" merged: what a whole encode gives

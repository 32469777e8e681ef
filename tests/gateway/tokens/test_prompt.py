"""Segment-cached tokenization is identical to tokenizing the whole rendered prompt."""

from __future__ import annotations

import functools
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from cortex.chat import ChatTokenizer, RenderArgs
from cortex.gateway.tokens.prompt import PromptTokenizer
from cortex.hashing import Engine

SPECIALS = [
    "<\uff5cUser\uff5c>",
    "<\uff5cAssistant\uff5c>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "</think>",
    "<think>",
    "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "<mask>",
]
WORDS = ["hello", " world", "\n", "\n\n", "  ", "123456", "über", "日本語のテキスト", "😀", "<b>",
         "<", "\uff5c", "tab\there", " 42", "x=1;", "END", "\r\n", "-", "'s", "don't"]


@functools.cache
def chat() -> ChatTokenizer:
    return ChatTokenizer.load()


@functools.cache
def shared() -> PromptTokenizer:
    # one instance across examples: later examples hit segments cached by earlier ones
    return PromptTokenizer(chat(), cache_tokens=200_000)


text = st.lists(st.sampled_from(WORDS + SPECIALS), max_size=30).map("".join)
message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": st.one_of(text, st.sampled_from(["You are a helpful assistant. " * 20])),
})
conversation = st.lists(message, min_size=1, max_size=8)


def render(tok: PromptTokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True
           ) -> str:
    return tok.render(RenderArgs.of(Engine.VLLM, messages,
                                    add_generation_prompt=add_generation_prompt))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation, st.booleans(), st.booleans())
def test_chat_prompt_tokens_equal_whole_prompt_tokenization(
    messages: list[dict[str, str]], add_generation_prompt: bool, add_special_tokens: bool
) -> None:
    tok = shared()
    rendered = render(tok, messages, add_generation_prompt)
    expected = chat().encode(rendered, add_special_tokens)
    assert tok.encode(rendered, add_special_tokens) == expected
    assert tok.encode(rendered, add_special_tokens) == expected  # warm: from the segment cache


@settings(max_examples=200, deadline=None)
@given(text)
def test_plain_text_tokens_equal_whole_text_tokenization(prompt: str) -> None:
    assert shared().encode_text(prompt) == chat().encode_text(prompt)


def test_long_system_prompt_is_tokenized_once() -> None:
    tok = PromptTokenizer(chat())
    system = {"role": "system", "content": "Rules of the house. " * 500}
    first = render(tok, [system, {"role": "user", "content": "question one"}])
    tok.encode(first, False)
    misses = tok.cache.stats.misses
    second = render(tok, [system, {"role": "user", "content": "question two"}])
    assert tok.encode(second, False) == chat().encode(second, False)
    # only the new user message was encoded
    assert tok.cache.stats.misses - misses == 1
    assert tok.cache.stats.hits >= 1


def test_cache_is_bounded_by_tokens() -> None:
    tok = PromptTokenizer(chat(), cache_tokens=50)
    for i in range(40):
        tok.encode_text(f"distinct prompt number {i} with some words")
    assert tok.cache.tokens <= 50
    assert tok.cache.stats.evictions > 0


def _tokenizer_with(*tokens: AddedToken) -> ChatTokenizer:
    base = chat()
    inner = Tokenizer.from_str(base.tokenizer.to_str())
    inner.add_special_tokens(list(tokens))
    return ChatTokenizer(inner, base.template, base.special_tokens, "test")


@functools.cache
def stripping() -> tuple[ChatTokenizer, PromptTokenizer]:
    custom = _tokenizer_with(AddedToken("<mask>", lstrip=True, rstrip=True, special=True),
                             AddedToken("END", rstrip=True, special=True))
    return custom, PromptTokenizer(custom)


@settings(max_examples=150, deadline=None)
@given(text)
def test_stripping_added_tokens_are_reproduced(prompt: str) -> None:
    custom, tok = stripping()
    assert tok.segmented
    assert tok.encode_text(prompt) == custom.encode_text(prompt)
    assert tok.encode(prompt, False) == custom.encode(prompt, False)


def test_single_word_tokens_disable_segmentation() -> None:
    custom = _tokenizer_with(AddedToken("word", single_word=True, special=True))
    tok = PromptTokenizer(custom)
    assert not tok.segmented
    assert tok.encode_text("a word, swords") == custom.encode_text("a word, swords")


def test_a_plan_counts_only_what_the_segment_cache_lacks() -> None:
    tok = PromptTokenizer(chat())
    system = {"role": "system", "content": "Rules of the house. " * 500}
    first = render(tok, [system, {"role": "user", "content": "question one"}])
    cold = tok.plan(first, False)
    assert cold.missing_chars >= len(system["content"])
    assert cold.finish().tolist() == chat().encode(first, False)
    second = render(tok, [system, {"role": "user", "content": "question two"}])
    warm = tok.plan(second, False)
    assert 0 < warm.missing_chars < 100  # the new question only
    assert warm.finish().tolist() == chat().encode(second, False)
    unsegmented = PromptTokenizer(_tokenizer_with(AddedToken("word", single_word=True)))
    whole = unsegmented.plan("a word, swords", True)
    assert whole.missing_chars == len("a word, swords")
    assert whole.finish().tolist() == unsegmented.chat.encode_text("a word, swords")


# chunk cuts everywhere they are allowed: tricky neighbours of " word" on both sides
CUTTABLE = [*WORDS, " a", " Zeta", "x", ".", "..", "'", "\u200b", "\u00a0", "\t", " ", "  ",
                    "7", " 8", "日本", "!a", "\n ", " \n", "é", "\u0301", "—"]
cuttable = st.lists(st.sampled_from(CUTTABLE + SPECIALS), max_size=60).map("".join)


@functools.cache
def chunked() -> PromptTokenizer:
    return PromptTokenizer(chat(), cache_tokens=200_000, chunk_chars=2)


@settings(max_examples=400, deadline=None)
@given(cuttable, st.booleans())
def test_chunked_text_tokens_equal_whole_text_tokenization(prompt: str, special: bool) -> None:
    tok = chunked()
    assert tok.chunk_chars == 2
    expected = chat().encode(prompt, special)
    assert tok.encode(prompt, special) == expected
    assert tok.encode(prompt, special) == expected  # warm


def test_a_prompt_extending_an_earlier_one_encodes_only_its_tail() -> None:
    tok = PromptTokenizer(chat(), chunk_chars=256)
    earlier = "Rules of the house, rule number one and rule number two. " * 60
    tok.encode_text(earlier)
    later = earlier + "And now a new question about the rules?"
    plan = tok.plan(later, True)
    assert plan.missing_chars < 256 + 64  # the last chunk of the earlier text and the tail
    assert plan.finish().tolist() == chat().encode_text(later)


def test_unknown_pre_tokenizers_are_not_chunked() -> None:
    described = json.loads(chat().tokenizer.to_str())
    described["pre_tokenizer"]["pretokenizers"][2]["pattern"]["Regex"] += "|x"
    base = chat()
    other = ChatTokenizer(Tokenizer.from_str(json.dumps(described)), base.template,
                          base.special_tokens, "test")
    assert PromptTokenizer(other).chunk_chars == 0
    assert PromptTokenizer(chat()).chunk_chars == 512

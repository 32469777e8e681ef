"""Prompts planned on a remembered head get the ids of the whole text tokenized at once
(a differential test on random edits), and only cut tokens end a head."""

from __future__ import annotations

import functools
import random
from array import array
from collections.abc import Callable

import pytest
from tokenizers import AddedToken, Tokenizer

from cortex.chat import ChatTokenizer, EncoderChoice, RenderArgs
from cortex.gateway.tokens.prompt import (
    BytesPerToken,
    Encoded,
    PrefixMemo,
    PromptTokenizer,
    cut_tokens,
    walk,
)
from cortex.hashing import Engine, block_keys

BLOCK = 16
WORDS = ["hello", " world", "\n", "\n\n", "  ", "123", "über", "日本語", "😀", "<b>", "<", ">",
         "\uff5c", " 42", "x=1;", "\r\n", "-", "'s", "q", "z", "<\uff5cUser\uff5c>",
         "<\uff5cAssistant\uff5c>", "</think>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
         "\uff5cDSML\uff5c", "<\uff5c/table>\uff5c"]


def test_cut_tokens_leave_out_what_a_continuation_could_change() -> None:
    tokens = {"<a>": False, "<a>b": False, "x>": False, ">y": False, "<r>": True,
              "<s]": False, "aba": False}
    # "<a>" is inside "<a>b"; a match of ">y" could start inside "x>"; "<r>" absorbs the
    # whitespace after it; "aba" overlaps itself ("a" ends it and starts it)
    assert cut_tokens(tokens) == frozenset({"<a>b", ">y", "<s]"})


@functools.cache
def custom() -> ChatTokenizer:
    """The default tokenizer plus tokens that a continuation can re-split: "<q>" (matched
    in the second, normalized pass) whose tail starts the special "q>z" (first pass), and
    "END", which absorbs the whitespace after it."""
    base = ChatTokenizer.load()
    inner = Tokenizer.from_str(base.tokenizer.to_str())
    inner.add_tokens([AddedToken("<q>", special=False, normalized=True)])
    inner.add_special_tokens([AddedToken("q>z", special=True),
                              AddedToken("END", rstrip=True, special=True)])
    return ChatTokenizer(inner, base.template, base.special_tokens, "test")


def _ids(tok: PromptTokenizer, text: str, special: bool) -> list[int]:
    """Planned and walked like routing does (the walk remembers the head); its block keys
    (a head's come from the head) are checked against the ids'."""
    w = walk(tok, tok.plan(text, special), 7, BLOCK, len, BytesPerToken())
    ids = w.finish(tok).tolist()
    assert w.keys == block_keys(ids, BLOCK, 7)
    return ids


def test_a_head_ending_in_a_token_a_continuation_re_splits_is_never_used() -> None:
    chat = custom()
    tok = PromptTokenizer(chat)
    assert tok.heads is not None
    assert "<q>" not in tok.heads.cuts and "END" not in tok.heads.cuts
    for head, more in (("hi there<q>", "z and more"), ("hi there END", "   tail")):
        assert _ids(tok, head, False) == chat.encode(head, False)
        assert _ids(tok, head + more, False) == chat.encode(head + more, False)
    # were those tokens cuts, the remembered ids would be wrong: this is what the rules
    # prevent
    unsafe = PromptTokenizer(chat)
    unsafe.heads = PrefixMemo(tok.heads.cuts | {"<q>", "END"}, 1 << 20)
    wrong = 0
    for head, more in (("hi there<q>", "z and more"), ("hi there END", "   tail")):
        _ids(unsafe, head, False)
        wrong += _ids(unsafe, head + more, False) != chat.encode(head + more, False)
    assert wrong == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("encoder", [EncoderChoice.HF, EncoderChoice.FASTOKENS])
def test_texts_extending_remembered_heads_get_the_whole_texts_ids(
        encoder: EncoderChoice) -> None:
    rng = random.Random(f"prefix/{encoder}")
    chat = ChatTokenizer.load()
    reference = chat.with_encoder(PromptTokenizer.load(encoder=encoder).encoder)
    tok = PromptTokenizer(reference, chunk_chars=rng.choice([0, 8, 64]))
    assert tok.heads is not None
    texts: list[str] = []
    for _ in range(400):
        roll = rng.random()
        if texts and roll < 0.6:  # an earlier text, cut anywhere, then more
            earlier = rng.choice(texts)
            text = earlier[:rng.randint(0, len(earlier))] if rng.random() < 0.3 else earlier
        elif texts and roll < 0.7:
            text = rng.choice(texts)  # the same text again
        else:
            text = ""
        text += "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
        texts.append(text)
        special = rng.random() < 0.3
        expected = reference.encode(text, special)
        assert _ids(tok, text, special) == expected, text
        plan = tok.plan(text, special)
        plan.remember = rng.random() < 0.5  # a routed prompt's full encode keeps its head
        assert plan.finish().tolist() == expected, text
    assert tok.heads.hits > 100  # the memo was exercised


def _nobody(keys: list[int]) -> int:
    return 0


@pytest.mark.parametrize("deepest", [len, _nobody, None],
                         ids=["walked-whole", "stopped-early", "encoded-whole"])
def test_agent_turns_reuse_the_previous_turns_head(deepest: Callable[[list[int]], int] | None
                                                   ) -> None:
    tok = PromptTokenizer(ChatTokenizer.load())
    assert tok.heads is not None
    messages = [{"role": "system", "content": "You are a coding agent. " * 40},
                {"role": "user", "content": "fix the bug in main.py"}]
    for turn in range(6):
        prompt = tok.prompt(RenderArgs.of(Engine.SGLANG, messages))
        plan = tok.plan_prompt(prompt)
        if turn:  # the history up to the last turn's end is one part
            assert isinstance(plan.parts[0], array) and plan.used is not None
            assert len(plan.parts) < 12
            # its keys came with it from the last turn's walk or keying: this turn hashes
            # none of them
            head = plan.used
            full = len(head.ids) // BLOCK * BLOCK
            assert head._chains == {(7, BLOCK): block_keys(head.ids[:full].tolist(), BLOCK, 7)}
        if deepest is None:  # encoded whole (PD, the ledger over gRPC): keyed on from the head
            plan.remember = True
            encoded = Encoded(plan.finish(), plan.used, plan.remembered)
            ids = list(encoded.ids)
            assert encoded.chain(7, BLOCK) == block_keys(ids, BLOCK, 7)
        else:
            w = walk(tok, plan, 7, BLOCK, deepest, BytesPerToken())
            assert w.complete is (deepest is len)  # the other stops at its first question
            ids = w.finish(tok, keyed=True).tolist()
            assert w.keys == block_keys(ids, BLOCK, 7)
        assert ids == tok.chat.encode_prompt(prompt)
        messages += [{"role": "assistant", "content": f"ran tool {turn}"},
                     {"role": "user", "content": f"tool output {turn} " * 5}]


def test_the_memo_is_bounded_by_bytes() -> None:
    memo = PrefixMemo({"<s>"}, max_bytes=3_000)
    for i in range(20):
        memo.remember(f"text {i} " * 20 + "<s>", False, list(range(50)))
    assert memo.bytes <= 3_000
    assert 0 < len(memo) < 20
    assert memo.find("text 19 " * 20 + "<s> more", False) is not None
    assert memo.find("text 0 " * 20 + "<s> more", False) is None  # evicted first

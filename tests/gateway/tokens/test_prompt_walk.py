"""Lazy tokenization credits the same blocks as full tokenization (a differential test on
random workloads), stops early for never-seen prompts, and its bounds hold."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest

from cortex.chat import EncoderChoice, render_args
from cortex.gateway.tokens.prompt import BytesPerToken, PromptTokenizer, held_prefix, walk
from cortex.hashing import Engine, HashDomain

BLOCK = 16
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega 12 345 6789 café über 日本 , . ; ( )").split()


@functools.cache
def base(encoder: EncoderChoice) -> PromptTokenizer:
    return PromptTokenizer.load(encoder=encoder)


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(rng: random.Random, system: str, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for _ in range(turns):
        messages.append({"role": "user", "content": prose(rng, rng.randint(5, 400))})
        messages.append({"role": "assistant", "content": prose(rng, rng.randint(5, 200))})
    messages.append({"role": "user", "content": prose(rng, rng.randint(1, 300))})
    return messages


@pytest.mark.timeout(300)
@pytest.mark.parametrize("encoder", [EncoderChoice.HF, EncoderChoice.FASTOKENS])
def test_lazily_and_fully_tokenized_decisions_credit_the_same_blocks(
        encoder: EncoderChoice) -> None:
    rng = random.Random(f"lazy/{encoder}")
    domain = HashDomain("m", BLOCK, Engine.VLLM)
    systems = [prose(rng, rng.randint(50, 900)) for _ in range(4)]
    held: dict[str, set[int]] = {f"w{i}": set() for i in range(4)}
    history: list[list[dict[str, Any]]] = []
    stopped = compared = 0
    for _ in range(120):
        tok = base(encoder).fork()  # a gateway that never saw the text (cold segment cache)
        roll = rng.random()
        if history and roll < 0.25:  # the same prompt again (a retry, another sample)
            messages = rng.choice(history)
        elif history and roll < 0.65:  # a later turn of an earlier conversation
            messages = [*rng.choice(history)]
            messages += [{"role": "assistant", "content": prose(rng, 30)},
                         {"role": "user", "content": prose(rng, rng.randint(1, 200))}]
        else:
            messages = conversation(rng, rng.choice(systems), rng.randint(0, 3))
        args = render_args({"messages": messages}, Engine.VLLM)
        prompt = tok.prompt(args)
        lora = rng.choice([None, None, "adapter-a"])
        ids = base(EncoderChoice.HF).fork().encode_prompt(prompt)  # the reference path
        keys = domain.keys(ids, lora)
        query = keys[:max(len(ids) - 1, 0) // BLOCK]
        full = {w: held_prefix(query, have) for w, have in held.items()}

        def deepest(ks: list[int]) -> int:
            return max(held_prefix(ks, have) for have in held.values())

        ratio = BytesPerToken()
        lazy = walk(tok, tok.plan_prompt(prompt), domain.root_key(lora), BLOCK, deepest, ratio)
        assert lazy.ids.tolist() == ids[:len(lazy.ids)]
        assert lazy.keys == keys[:len(lazy.keys)]
        lazy_query = (lazy.keys[:max(len(ids) - 1, 0) // BLOCK] if lazy.complete
                      else lazy.keys)
        assert {w: held_prefix(lazy_query, have) for w, have in held.items()} == full
        assert lazy.max_tokens() >= len(ids)
        if not lazy.complete:
            stopped += 1
        compared += 1
        assert lazy.finish(tok).tolist() == ids
        # a worker computes it (some only partly: evicted tails), the ledger learns its keys
        worker = rng.choice(list(held))
        held[worker].update(keys if rng.random() < 0.5 else keys[:rng.randint(0, len(keys))])
        history.append(messages)
    assert compared == 120
    assert stopped >= 20 and compared - stopped >= 5  # both outcomes occur


def test_a_never_seen_prompt_is_encoded_only_up_to_the_first_block() -> None:
    tok = base(EncoderChoice.HF).fork()
    text = prose(random.Random(3), 4_000)
    plan = tok.plan(text, True)
    ratio = BytesPerToken()
    lazy = walk(tok, plan, 7, BLOCK, lambda keys: 0, ratio)
    assert not lazy.complete and lazy.deepest == 0
    whole = tok.encode(text, True)
    assert len(lazy.ids) < len(whole) // 10  # one chunk of ~512 characters
    estimate = lazy.estimated_tokens(ratio)
    assert abs(estimate - len(whole)) / len(whole) < 0.2
    assert lazy.max_tokens() >= len(whole)
    assert lazy.rest_pieces > 0 and lazy.rest_bytes > 0
    assert lazy.finish(tok).tolist() == whole
    # the rest went into the segment cache: the next time it is all hits
    assert tok.plan(text, True).missing == []


def test_a_prompt_every_block_of_which_is_held_is_encoded_fully() -> None:
    tok = base(EncoderChoice.HF).fork()
    text = prose(random.Random(4), 600)
    lazy = walk(tok, tok.plan(text, False), 7, BLOCK, len)
    assert lazy.complete and lazy.ids.tolist() == tok.encode(text, False)
    assert lazy.estimated_tokens(BytesPerToken()) == len(lazy.ids) == lazy.max_tokens()


def test_the_ratio_learns_bytes_per_token() -> None:
    ratio = BytesPerToken(initial=1.0, window=1_000)
    for _ in range(50):
        ratio.observe(4_000, 1_000)
    assert ratio.ratio == pytest.approx(4.0, rel=1e-3)
    assert ratio.tokens_of(400) == 100 and ratio.tokens_of(0) == 0
    ratio.observe(10, 0)  # nothing encoded: nothing learned
    assert ratio.ratio == pytest.approx(4.0, rel=1e-3)


def test_a_prompt_whose_pieces_are_cached_is_taken_whole_and_never_asked() -> None:
    tok = base(EncoderChoice.HF).fork()
    text = prose(random.Random(8), 2_000)
    asks: list[int] = []

    def nobody(keys: list[int]) -> int:
        asks.append(len(keys))
        return 0

    first = walk(tok, tok.plan(text, True), 7, BLOCK, nobody)
    assert not first.complete and asks == [len(first.keys)]  # stopped at the first ask
    first.finish(tok)  # the rest into the segment cache
    asks.clear()
    again = walk(tok, tok.plan(text, True), 7, BLOCK, nobody)
    assert again.complete and again.ids.tolist() == tok.encode(text, True)
    # nothing to encode: no ask before the end, and none at it (the router asks the ledger
    # next, of every key)
    assert asks == [] and len(again.keys) == len(again.ids) // BLOCK

"""Which implementation turns text into ids for a model: Hugging Face ``tokenizers``, or
``fastokens`` where it provably gives the same ids.

``fastokens`` (a Rust BPE encoder that loads the same ``tokenizer.json``) encodes long text
several times faster, but its authors warn that some normalizers and pre-tokenizers are not
supported. So it is never trusted on its word: :func:`select_encoder` loads it, runs a
parity probe against ``tokenizers`` (:func:`parity_corpus`: words, code, numbers, random
Unicode, whitespace runs, the model's added tokens alone and in context, rendered chat
samples, each with and without the post-processor's special tokens) and keeps it only when
every id matches. Any failure to load or any difference selects ``tokenizers``, with the
reason in :attr:`Encoder.reason`.

The simulated engines always use ``tokenizers`` (they stand for the engines), so tests that
compare the gateway's ids to the sim's compare two implementations.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from tokenizers import Tokenizer

__all__ = ["Encoder", "EncoderChoice", "hf_encoder", "parity_corpus", "parity_mismatch",
           "select_encoder"]

log = logging.getLogger(__name__)


class EncoderChoice(StrEnum):
    """``auto``: ``fastokens`` when the probe passes, else ``tokenizers``; ``hf``: always
    ``tokenizers``; ``fastokens``: ``fastokens`` or a load error (never silently slower)."""

    AUTO = "auto"
    HF = "hf"
    FASTOKENS = "fastokens"


class _Encoding(Protocol):
    @property
    def ids(self) -> list[int]: ...


class _Backend(Protocol):
    """What both libraries' tokenizers offer for encoding."""

    def encode_batch(self, inputs: list[str], add_special_tokens: bool = ...
                     ) -> Sequence[_Encoding]: ...


@dataclass(frozen=True, slots=True)
class Encoder:
    """Text → ids with one implementation: ``name`` is ``hf`` or ``fastokens``; ``reason``
    says why it was chosen (one line, for logs and ``/admin/models``)."""

    name: str
    reason: str
    backend: Any  # a tokenizers.Tokenizer or a fastokens.Tokenizer (_Backend)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` applies the post-processor."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_each(self, texts: Iterable[tuple[str, bool]]) -> list[list[int]]:
        """Ids of each ``(text, add_special_tokens)``, one text per call: ``encode_batch``
        releases the GIL while it works (``tokenizers``' ``encode`` does not), and one text
        per call keeps the library's own thread pool out of it."""
        encode = self.backend.encode_batch
        return [list(encode([text], add_special_tokens=special)[0].ids)
                for text, special in texts]

    def warm(self) -> None:
        """Encode once on the calling thread. fastokens sets up state per thread on its
        first encode there: 4 to 230 ms measured on these machines (most for the first thread
        after the one that loaded it), which the first request to reach that thread would
        otherwise pay."""
        self.encode_each([("warm up", False)])


def hf_encoder(tokenizer: Tokenizer, reason: str = "configured: hf") -> Encoder:
    return Encoder("hf", reason, tokenizer)


# -- the parity probe --------------------------------------------------------------------

_WORDS = ("Hello", "world", "the", "quick", "brown", "fox", "don't", "it's", "We'LL",
          "café", "über", "naïve", "Ελληνικά", "русский", "日本語のテキスト", "中文字符",
          "한국어", "עברית", "العربية", "हिन्दी", "ไทย", "😀", "👩‍💻", "🇫🇷", "ﬁ", "Ⅻ",
          "e\u0301", "A\u030a", "x=1;", "def f(a, b):", "return a+b", "{\"k\": [1, 2]}",
          "<b>", "</div>", "#include <stdio.h>", "SELECT * FROM t;", "$HOME", "--flag",
          "3.14159", "1,000,000", "0x1F", "2026-12-04T17:27:40Z", "12345678901234567890",
          "...", "!!!", "???", "—", "«»", "\u2019", "\\n", "`code`", "**bold**", "_x_")
_SPACES = (" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000",
           "\u2003", "\x0b", "\x0c", "\u200b", "        ", "\n\n\n\n")
_RANGES = ((0x20, 0x7e), (0xa0, 0x24f), (0x300, 0x36f), (0x370, 0x52f), (0x590, 0x6ff),
           (0x900, 0x97f), (0xe00, 0xe7f), (0x1100, 0x11ff), (0x2000, 0x2bff),
           (0x3000, 0x30ff), (0x4e00, 0x4fff), (0xac00, 0xacff), (0xfb00, 0xfb4f),
           (0xff00, 0xffef), (0x1f300, 0x1f6ff), (0x1f900, 0x1f9ff), (0x10000, 0x1007f),
           (0x0, 0x1f))


def _random_text(rng: random.Random, size: int) -> str:
    out: list[str] = []
    while sum(map(len, out)) < size:
        roll = rng.random()
        if roll < 0.45:
            out.append(rng.choice(_WORDS))
        elif roll < 0.7:
            out.append(rng.choice(_SPACES))
        elif roll < 0.85:
            out.append(str(rng.randrange(10 ** rng.randint(1, 12))))
        else:
            low, high = rng.choice(_RANGES)
            out.append("".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 6))))
        if rng.random() < 0.5:
            out.append(" ")
    return "".join(out)


def parity_corpus(added_tokens: Sequence[str], samples: Sequence[str] = (),
                  seed: int = 2026) -> list[str]:
    """Texts the probe compares: fixed and seeded-random text of every kind above, each
    added token alone, glued and spaced between words, and ``samples`` (rendered chat
    prompts) whole. Deterministic for a seed."""
    rng = random.Random(seed)
    texts = ["", *_WORDS, *_SPACES, " ".join(_WORDS), "".join(_WORDS), "".join(_SPACES)]
    texts += [_random_text(rng, rng.choice((16, 64, 256, 1024))) for _ in range(160)]
    texts.append(_random_text(rng, 20_000))  # one long text: the paths for long inputs
    for token in added_tokens:
        word = rng.choice(_WORDS)
        texts += [token, token + token, f"{word}{token}{word}", f"{word} {token} {word}",
                  f"\n{token}\n", f" {token}  "]
    if added_tokens:
        texts.append("".join(rng.choice(_WORDS) + rng.choice(added_tokens) for _ in range(64)))
    texts += samples
    return texts


def parity_mismatch(reference: Any, candidate: Any, texts: Sequence[str]) -> str | None:
    """The first text whose ids differ between the two tokenizers (either value of
    ``add_special_tokens``), described in one line; ``None`` when all agree."""
    for special in (False, True):
        want = reference.encode_batch(list(texts), add_special_tokens=special)
        got = candidate.encode_batch(list(texts), add_special_tokens=special)
        for text, a, b in zip(texts, want, got, strict=True):
            if list(a.ids) != list(b.ids):
                at = next((i for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False))
                           if x != y), min(len(a.ids), len(b.ids)))
                return (f"ids differ at token {at} of {text[:40]!r}"
                        f"{'...' if len(text) > 40 else ''} "
                        f"(add_special_tokens={special}, {len(a.ids)} vs {len(b.ids)} ids)")
    return None


def _load_fastokens(json_text: str) -> Any:
    import fastokens

    return fastokens.Tokenizer.from_json_str(json_text)


def select_encoder(tokenizer: Tokenizer, json_text: str, choice: EncoderChoice,
                   samples: Sequence[str] = (), label: str = "") -> Encoder:
    """The encoder for a model (``json_text``: its ``tokenizer.json``; ``samples``: rendered
    chat prompts for the probe; ``label``: names the model in the log line). Raises
    ``ValueError`` for ``choice`` ``fastokens`` when it cannot load or the probe fails."""
    choice = EncoderChoice(choice)
    if choice is EncoderChoice.HF:
        return hf_encoder(tokenizer)
    try:
        fast = _load_fastokens(json_text)
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        mismatch = parity_mismatch(tokenizer, fast, parity_corpus(added, samples))
        reason = (f"unsupported: parity probe failed, {mismatch}" if mismatch else
                  f"parity probe passed ({choice.value})")
    except Exception as exc:  # any load error of the optional encoder means "not supported"
        fast, mismatch = None, "load"
        reason = f"unsupported: fastokens cannot load it ({type(exc).__name__}: {exc})"
    if mismatch is None:
        log.info("tokenizer %s encodes with fastokens: %s", label, reason)
        return Encoder("fastokens", reason, fast)
    if choice is EncoderChoice.FASTOKENS:
        raise ValueError(f"tokenize.encoder is fastokens but {reason}")
    log.warning("tokenizer %s encodes with tokenizers (hf): %s", label, reason)
    return hf_encoder(tokenizer, reason)

"""The encoder choice: fastokens only where its ids equal tokenizers', else tokenizers with
the reason (cortex.chat.encoder)."""

from __future__ import annotations

import functools
import gzip
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from cortex.chat import ChatTokenizer, EncoderChoice, default_tokenizer_dir, select_encoder
from cortex.chat.encoder import parity_corpus, parity_mismatch

QWEN = Path(__file__).parent / "data" / "qwen3.5"


@functools.cache
def qwen_json() -> str:
    return gzip.decompress((QWEN / "tokenizer.json.gz").read_bytes()).decode("utf-8")


@functools.cache
def deepseek_json() -> str:
    return (default_tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8")


def tiny_tokenizer(normalizer: normalizers.Normalizer | None) -> Tokenizer:
    """A small byte-level BPE trained here (with an optional normalizer)."""
    tok = Tokenizer(BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["hello world the quick brown fox", "café über 12345"] * 8,
                            trainers.BpeTrainer(initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet(), special_tokens=["<s>"]))
    return tok


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [None, QWEN], ids=["deepseek-v4", "qwen3.5"])
def test_the_probe_passes_for_the_shipped_tokenizers(path: Path | None) -> None:
    chat = ChatTokenizer.load(path, encoder=EncoderChoice.AUTO)
    assert chat.encoder is not None
    assert chat.encoder.name == "fastokens", chat.encoder.reason
    assert chat.encoder.reason == "parity probe passed (auto)"
    hf = ChatTokenizer.load(path)
    assert hf.encoder is not None and hf.encoder.name == "hf"
    samples = chat.probe_samples()
    assert len(samples) >= 3 and any("<" in s for s in samples)  # rendered chat, specials
    for text in samples:
        for special in (False, True):
            assert chat.encode(text, special) == hf.encode(text, special)


def test_the_corpus_covers_added_tokens_in_context_and_is_deterministic() -> None:
    texts = parity_corpus(["<|x|>"], ["SAMPLE"])
    assert texts == parity_corpus(["<|x|>"], ["SAMPLE"])
    assert "<|x|>" in texts and "SAMPLE" in texts
    assert any(t.startswith(" <|x|>") for t in texts)
    assert any(len(t) >= 20_000 for t in texts)
    assert any("\u3000" in t for t in texts) and any(ord(c) > 0xffff for t in texts for c in t)


@pytest.mark.timeout(120)
def test_a_tokenizer_it_does_not_reproduce_falls_back_to_hf_with_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    # fastokens loads a real tokenizer.json, but not the one tokenizers uses: ids differ
    hf = ChatTokenizer.load().tokenizer
    with caplog.at_level(logging.WARNING, logger="cortex.chat.encoder"):
        encoder = select_encoder(hf, qwen_json(), EncoderChoice.AUTO, label="deepseek")
    assert encoder.name == "hf" and encoder.backend is hf
    assert encoder.reason.startswith("unsupported: parity probe failed, ids differ at token")
    assert "add_special_tokens=False" in encoder.reason
    assert any("deepseek" in r.getMessage() and encoder.reason in r.getMessage()
               for r in caplog.records)


def test_an_unsupported_component_falls_back_to_hf_with_the_reason() -> None:
    tok = tiny_tokenizer(normalizers.NFKD())  # a normalizer fastokens does not implement
    encoder = select_encoder(tok, tok.to_str(), EncoderChoice.AUTO)
    assert encoder.name == "hf"
    assert encoder.reason.startswith("unsupported: fastokens cannot load it (ValueError: ")
    assert "NFKD" in encoder.reason
    assert encoder.encode("hello café", False) == tok.encode("hello café").ids


def test_a_supported_tiny_tokenizer_passes() -> None:
    tok = tiny_tokenizer(None)
    encoder = select_encoder(tok, tok.to_str(), EncoderChoice.AUTO)
    assert encoder.name == "fastokens", encoder.reason
    assert encoder.encode_each([("hello world", False), ("<s>brown", True)]) == [
        tok.encode("hello world", add_special_tokens=False).ids,
        tok.encode("<s>brown", add_special_tokens=True).ids]


def test_demanding_fastokens_where_it_is_not_exact_is_an_error() -> None:
    tok = tiny_tokenizer(normalizers.NFKD())
    with pytest.raises(ValueError, match=r"tokenize\.encoder is fastokens but unsupported"):
        select_encoder(tok, tok.to_str(), EncoderChoice.FASTOKENS)


def test_hf_is_never_probed() -> None:
    tok = tiny_tokenizer(None)
    encoder = select_encoder(tok, "not json at all", EncoderChoice.HF)
    assert (encoder.name, encoder.reason) == ("hf", "configured: hf")
    with pytest.raises(ValueError):
        select_encoder(tok, tok.to_str(), "fast")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_parity_mismatch_names_the_first_differing_text() -> None:
    import fastokens

    hf = Tokenizer.from_str(deepseek_json())
    fast = fastokens.Tokenizer.from_json_str(deepseek_json())
    assert parity_mismatch(hf, fast, ["hello", "world"]) is None
    other = fastokens.Tokenizer.from_json_str(qwen_json())
    found = parity_mismatch(hf, other, ["", "hello world"])
    assert found is not None and "'hello world'" in found

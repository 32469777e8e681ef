"""Golden vectors: recomputed by this build, and pinned to HASH_VERSION."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cortex.hashing import vectors
from cortex.hashing.keys import HASH_VERSION


def test_this_build_reproduces_the_committed_key_vectors() -> None:
    assert vectors.check_key_vectors(vectors.load_key_vectors()) == []


def test_the_hash_version_has_its_own_golden_file() -> None:
    # Bumping HASH_VERSION without committing golden/keys_v<new>.json fails here.
    path = vectors.key_vectors_path()
    assert path.name == f"keys_v{HASH_VERSION}.json"
    assert path.is_file(), f"commit golden vectors for HASH_VERSION {HASH_VERSION}"
    assert json.loads(path.read_text(encoding="utf-8"))["hash_version"] == HASH_VERSION


def test_the_generator_reproduces_the_committed_file() -> None:
    # Same inputs, same outputs: a changed key function or case list shows here.
    assert vectors.build_key_vectors() == vectors.load_key_vectors()


def test_the_vectors_cover_what_they_claim() -> None:
    doc = vectors.load_key_vectors()
    assert len(doc["domains"]) >= 5
    assert {d["engine"] for d in doc["domains"]} == {"sglang", "vllm"}
    assert {(r["lora_name"] is None, r["cache_salt"] is None) for r in doc["roots"]} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    lists = doc["token_lists"]
    assert any(len(tokens) % 16 for tokens in lists.values() if len(tokens) > 16)
    assert max(max(tokens, default=0) for tokens in lists.values()) == 2**32 - 1
    assert doc["continuations"]


def test_a_tampered_vector_is_reported() -> None:
    doc = copy.deepcopy(vectors.load_key_vectors())
    doc["chains"][5]["keys"][0] = "1"
    doc["roots"][1]["root"] = "2"
    problems = vectors.check_key_vectors(doc)
    assert len(problems) == 2
    assert problems[0].startswith("root") and problems[1].startswith("chain")


def test_the_engine_vectors_and_the_self_check_pass() -> None:
    assert vectors.check_engine_vectors() == []
    assert vectors.self_check() == []


def test_a_missing_golden_file_fails_the_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vectors, "key_vectors_path", lambda version: Path("/nonexistent.json"))
    assert vectors.self_check() == [
        f"no golden vectors keys_v{HASH_VERSION}.json for HASH_VERSION {HASH_VERSION}"
    ]


def test_golden_files_are_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    assert vectors.main(["write", "--out", str(path)]) == 0
    assert json.loads(path.read_text(encoding="utf-8")) == vectors.load_key_vectors()
    assert vectors.main(["write", "--out", str(path)]) == 1
    assert vectors.main(["write", "--out", str(path), "--force"]) == 0
    assert vectors.main(["check"]) == 0

"""``cortex hash``: through the umbrella command, and once as a real process."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from cortex.edge.main import main
from cortex.hashing.cli import MAX_TOKENS, InputError, parse_tokens
from cortex.hashing.keys import Engine, HashDomain

VLLM_SHA256 = "1403909460543360175\n1643945449041937783\n"
SGLANG_1_48 = "8635429971592222890\n1256577331724852459\n5689809685380680247\n"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["hash", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_prints_one_unsigned_decimal_per_full_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "keys", "--model", "m", "--block-size", "16", "--tokens", "1-40")
    expected = HashDomain("m", 16, Engine.SGLANG).keys(list(range(1, 41)))
    assert (code, err) == (0, "")
    assert out == "".join(f"{key}\n" for key in expected)
    assert len(out.splitlines()) == 2


def test_keys_with_engine_lora_and_salt(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["keys", "--model", "m", "--block-size", "4", "--tokens", "1-16,40,41,42,43"]
    code, out, _ = run(capsys, *argv, "--engine", "vllm", "--lora-name", "ad", "--cache-salt", "t")
    tokens = [*range(1, 17), 40, 41, 42, 43]
    expected = HashDomain("m", 4, Engine.VLLM).keys(tokens, "ad", "t")
    assert code == 0
    assert [int(line) for line in out.splitlines()] == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--engine", "vllm"], VLLM_SHA256),
        (
            ["--engine", "vllm", "--algo", "sha256_cbor"],
            "8866452693264111234\n807986237951177663\n",
        ),
        (["--engine", "sglang", "--tokens", "1-48"], SGLANG_1_48),
        (["--engine", "sglang", "--tokens", "1-16", "--cache-salt", "s1"], "2241309735000630258\n"),
    ],
)
def test_engine_prints_the_spec_vectors(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    tokens = [] if "--tokens" in argv else ["--tokens", "1-32"]
    code, out, err = run(capsys, "engine", "--block-size", "16", *tokens, *argv)
    assert (code, out, err) == (0, expected, "")


def test_engine_digests_and_seed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "engine", "--engine", "vllm", "--block-size", "16", "--tokens", "1-32", "--digests"
    )
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2 and all(len(line) == 64 for line in lines)
    assert int(lines[0], 16) & (2**64 - 1) == 1403909460543360175
    argv = ["engine", "--engine", "vllm", "--seed", "0", "--block-size", "16", "--tokens", "1-32"]
    code, seeded, _ = run(capsys, *argv)
    assert code == 0 and seeded != VLLM_SHA256 and len(seeded.splitlines()) == 2


def test_tokens_from_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stdin = io.StringIO("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16\n17-32\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, _ = run(capsys, "engine", "--engine", "vllm", "--block-size", "16", "--tokens", "-")
    assert (code, out) == (0, VLLM_SHA256)


def test_check_reports_ok(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check")
    assert (code, err) == (0, "")
    assert out.startswith("ok: ")


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "--model", "m", "--block-size", "x", "--tokens", "1"],
        ["keys", "--model", "m", "--block-size", "0", "--tokens", "1"],
        ["keys", "--model", "m", "--block-size", "4", "--tokens", "1-a"],
        ["keys", "--model", "m", "--block-size", "4", "--tokens", "9-3"],
        ["keys", "--model", "m", "--block-size", "4", "--tokens", "4294967296"],
        ["keys", "--model", "m", "--block-size", "4", "--tokens", "-5"],
        ["keys", "--model", "m", "--block-size", "4", "--tokens", "1", "--engine", "tgi"],
        ["keys", "--model", "", "--block-size", "4", "--tokens", "1"],
        ["engine", "--engine", "vllm", "--algo", "md5", "--block-size", "4", "--tokens", "1"],
        ["engine", "--engine", "sglang", "--seed", "0", "--block-size", "4", "--tokens", "1"],
        ["engine", "--engine", "sglang", "--lora-name", "a", "--block-size", "4", "--tokens", "1"],
        ["engine", "--engine", "vllm", "--block-size", "4", "--tokens", "18446744073709551616"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("cortex hash: error: ")
    assert err.count("\n") == 1


def test_parse_tokens() -> None:
    assert parse_tokens("1-16,40,41") == [*range(1, 17), 40, 41]
    assert parse_tokens(" 1, 2 ,3\n4-5 ") == [1, 2, 3, 4, 5]
    assert parse_tokens("7-7") == [7]
    assert parse_tokens("") == []
    for bad in ("1.5", "a", "1-", "-1", "3-1", "1--2"):
        with pytest.raises(InputError):
            parse_tokens(bad)
    with pytest.raises(InputError, match="more than"):
        parse_tokens(f"0-{MAX_TOKENS}")


def test_a_real_process_prints_the_vectors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cortex.edge.main", "hash", "engine", "--engine", "sglang",
         "--block-size", "16", "--tokens", "1-48"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (0, SGLANG_1_48, "")

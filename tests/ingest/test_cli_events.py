"""`cortex events decode` / `cortex events bench` through the umbrella CLI."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from cortex.edge.main import main
from cortex.kvevents.codec import AllBlocksCleared, BlockStored, EventBatch, encode_batch

pytestmark = pytest.mark.timeout(30)

# SGLang 0.5.23 golden full batch: 3-block store, salted store, removal, clear.
SGLANG_FULL = (
    "93cb41d954fc402000009487a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "93cf77d735ce838418aacf1170426cf2449cebcf4ef643c350b14a37b1706172656e745f626c6f636b5f"
    "68617368c0a9746f6b656e5f696473dc00300102030405060708090a0b0c0d0e0f101112131415161718"
    "191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f30aa626c6f636b5f73697a6510a76c6f72615f"
    "6964c0a66d656469756da347505588a474797065ab426c6f636b53746f726564ac626c6f636b5f686173"
    "686573 91cf1f1abb543a5663f2b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473"
    "dc00100102030405060708090a0b0c0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d"
    "656469756da3475055aa63616368655f73616c74a2733183a474797065ac426c6f636b52656d6f766564"
    "ac626c6f636b5f68617368657391cf4ef643c350b14a37a66d656469756da347505581a474797065b041"
    "6c6c426c6f636b73436c656172656400"
)


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_decode_hex_prints_one_json_line_per_event(capsys: pytest.CaptureFixture[str]) -> None:
    # Whitespace inside the hex is allowed (pasted from logs).
    assert main(["events", "decode", "--engine", "sglang", "--hex", SGLANG_FULL]) == 0
    out, err = capsys.readouterr()
    records = _lines(out)
    assert err == ""
    assert [r["type"] for r in records] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert all(r["ts"] == 1700000000.5 and r["dp_rank"] == 0 for r in records)
    assert records[0]["block_hashes"] == [
        8635429971592222890,
        1256577331724852459,
        5689809685380680247,
    ]
    assert records[0]["token_ids"] == list(range(1, 49))
    assert records[1]["cache_salt"] == "s1"
    assert "group_idx_nil" not in records[0]


def test_decode_file_with_bin_hashes_as_hex(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    digest = bytes(range(32))
    event = BlockStored((digest,), digest[::-1], (1, 2), 2, medium="GPU", extra_keys=((b"\x01",),))
    payload = encode_batch(EventBatch(5.0, (event,), 3), "vllm", "0.33.0")
    path = tmp_path / "payload.bin"
    path.write_bytes(payload)
    assert main(["events", "decode", "--engine", "vllm", str(path)]) == 0
    (record,) = _lines(capsys.readouterr().out)
    assert record["block_hashes"] == [digest.hex()]
    assert record["parent_block_hash"] == digest[::-1].hex()
    assert record["extra_keys"] == [["01"]]
    assert (record["ts"], record["dp_rank"]) == (5.0, 3)


def test_decode_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    payload = encode_batch(EventBatch(1.0, (AllBlocksCleared(),)), "vllm", "0.9.0")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(payload)))
    assert main(["events", "decode", "--engine", "vllm", "-"]) == 0
    assert _lines(capsys.readouterr().out) == [
        {"ts": 1.0, "dp_rank": None, "type": "AllBlocksCleared"}
    ]


def test_unknown_events_are_reported_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    # [1.0, [{"type": "Future"}], 0]
    payload = "93cb3ff000000000000091 81a474797065a6467574757265 00"
    assert main(["events", "decode", "--engine", "vllm", "--hex", payload]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "skipped 1 event(s) of unknown type" in err


@pytest.mark.parametrize(
    "source",
    [
        ["--hex", "93cb41d9"],  # truncated
        ["--hex", "zz"],  # not hex
        ["--hex", "92cb7ff800000000000090"],  # NaN ts
        ["/nonexistent/payload.bin"],
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_1(
    source: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["events", "decode", "--engine", "sglang", *source]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("cortex events decode: error: ") and err.count("\n") == 1


def test_engine_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["events", "decode", "--hex", "90"])
    assert info.value.code == 2
    assert "--engine" in capsys.readouterr().err


def test_bench_reports_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["events", "bench", "--seconds", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["case", "bytes"]
    assert len(lines) == 9
    assert all(float(line.split()[-1].replace(",", "")) > 0 for line in lines[1:])

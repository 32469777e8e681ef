"""``cortex bench capacity``: prompts, the line fit and the report (no processes)."""

from __future__ import annotations

import pytest

from cortex.bench.capacity import SizeResult, _prompts, fit_line, report_json, report_markdown
from cortex.bench.routing.command import load_chat_tokenizer
from cortex.bench.routing.text import BlockText, WordVocabulary


def test_fit_line_recovers_a_line() -> None:
    a, b = fit_line([1000, 2000, 4000], [1.5, 2.0, 3.0])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.0005)
    assert fit_line([5], [2.0]) == (2.0, 0.0)


def test_prompts_share_a_group_prefix_and_have_the_size_asked() -> None:
    chat = load_chat_tokenizer()
    text = BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), 512)
    prompts = _prompts(text, 2048, requests=4, share=0.6, groups=2, first_block=0)
    assert prompts[0][0] == prompts[2][0] and prompts[0][0] != prompts[1][0]
    assert len({p[1]["content"] for p in prompts}) == 4
    words = [len(m["content"].split()) for m in prompts[0]]
    assert words == [round(2048 * 0.6), 2048 - round(2048 * 0.6)]


def test_multi_turn_prompts_resend_the_history_with_a_new_turn() -> None:
    chat = load_chat_tokenizer()
    text = BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), 512)
    prompts = _prompts(text, 1024, requests=6, share=0.5, groups=1, first_block=0, turns=3)
    first, second, third = prompts[0], prompts[2], prompts[4]  # one conversation's turns
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant",
                                          "user"]
    assert second[:2] == first and third[:4] == second
    assert prompts[1][1] != first[1]  # the other conversation


def test_report_derives_per_request_and_per_update_costs() -> None:
    cpu = {"gateway-0": 3.0, "gateway-1": 1.0, "index": 0.5, "ingest": 2.0, "redis": 0.0}
    res = SizeResult("replica", 4096, 100, 0, 10.0, cpu, stored_blocks=90_000,
                     evicted_blocks=10_000)
    assert res.request_path_ms == pytest.approx(20.0)
    assert res.per_update_us("gateway-1") == pytest.approx(10.0)
    doc = report_json([res], {"command": "x", "date": "d", "minutes": 1.0, "machine": "m",
                              "workers": 4, "concurrency": 4, "prefix_share": 0.6,
                              "groups": 8, "kv_blocks": 1, "block_size": 16})
    assert doc["modes"]["replica"]["us_per_update"]["ingest"] == pytest.approx(20.0)
    assert doc["sizes"][0]["updates_per_request"] == 1000
    assert doc["sizes"][0]["pipeline_ms_per_request"] == pytest.approx(25.0)
    assert "| replica | 4,096 | 100 | 20.00 | 5.00 | 25.00 | 1,000 |" in report_markdown(doc)

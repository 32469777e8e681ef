"""``cortex bench routing`` options, profiles and workload construction (no processes)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest

from cortex.bench.routing import command as routing
from cortex.bench.routing.contenders import Deployment, cpu_split, pinned
from cortex.bench.routing.runner import pool_fraction, worker_capacity
from cortex.bench.routing.scenarios import VARIANTS
from cortex.bench.routing.text import BlockText, WordVocabulary
from cortex.bench.routing.workloads import Workload


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing.register(parser.add_subparsers())
    return parser.parse_args(["routing", *argv])


@pytest.fixture(scope="module")
def text() -> BlockText:
    chat = routing.load_chat_tokenizer()
    return BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), 32)


def test_profiles_and_overrides() -> None:
    assert routing._profile(_args()) == routing.FULL
    assert routing._profile(_args("--quick")) == routing.QUICK
    p = routing._profile(_args("--quick", "--workers", "3", "--trace-speedup", "2",
                               "--capacity-fraction", "0.5"))
    assert (p.workers, p.trace_speedup, p.capacity_fraction) == (3, 2.0, 0.5)
    assert routing.FULL.scaled(6000) == 375 and routing.FULL.token_scale == 1 / 16


def test_cortex_runs_with_its_default_weights_unless_told() -> None:
    assert routing.cortex_weights(_args()) == {}
    assert routing.cortex_weights(_args("--alpha", "2", "--gamma", "0")) == {"alpha": 2.0,
                                                                            "gamma": 0.0}


def test_choice_rejects_unknown_names() -> None:
    assert routing._choice("multi_turn,shared_prefix", routing.WORKLOADS, "workloads") == [
        "shared_prefix", "multi_turn"]
    with pytest.raises(SystemExit, match="unknown"):
        routing._choice("cortex,nginx", ("cortex",), "contenders")


def test_a_pools_fraction_is_the_variants_then_the_workloads_then_the_profiles() -> None:
    plain = Workload("w", "t", "s", ())
    own = dataclasses.replace(plain, capacity_fraction=0.1)
    assert pool_fraction(0.3, plain, None) == 0.3
    assert pool_fraction(0.3, own, None) == 0.1
    assert pool_fraction(0.3, own, VARIANTS["kv_pressure"]) == 0.1  # the variant's 0.1
    assert pool_fraction(0.3, own, dataclasses.replace(VARIANTS["kv_pressure"],
                                                       capacity_fraction=0.05)) == 0.05
    assert pool_fraction(0.3, own, dataclasses.replace(VARIANTS["kv_pressure"],
                                                       capacity_fraction=None)) == 0.1


def test_worker_capacity_rule() -> None:
    assert worker_capacity(0.3, 10_000, 100) == 3000
    assert worker_capacity(0.3, 1000, 200) == 800       # room for four of the largest
    assert worker_capacity(0.01, 100, 1) == 256


def test_quick_workloads_are_deterministic_and_complete(text: BlockText) -> None:
    traces = routing._traces_dir(None)
    if not traces.is_dir():
        pytest.skip(f"no traces at {traces}")
    build: Any = routing.build_workloads
    a = build(routing.QUICK, text, routing.WORKLOADS, traces, 0, text)
    b = build(routing.QUICK, text, routing.WORKLOADS, traces, 0, text)
    with pytest.raises(ValueError, match="vision_text"):  # its words are its model's
        build(routing.QUICK, text, ["multimodal"], traces, 0)
    assert [w.name for w in a] == list(routing.WORKLOADS)
    assert [w.digest() for w in a] == [w.digest() for w in b]
    by_name = {w.name: w for w in a}
    small = by_name["mooncake_conversation_small_kv"]
    assert small.kv_blocks == routing.QUICK.small_kv_blocks and a[0].kv_blocks is None
    assert [r.prompt for r in small.requests] == [r.prompt for r in a[0].requests]
    assert all(len(w.requests) > 0 for w in a)
    # replica variants replay their base workload unchanged
    for n in (1, 2, 4):
        assert [r.digest() for r in by_name[f"shared_prefix_r{n}"].requests] == [
            r.digest() for r in by_name["shared_prefix"].requests]
    steady = by_name["churn"]
    assert steady.stages == (routing.QUICK.steady_rate,)
    assert steady.open_loop_span_s <= routing.QUICK.steady_s
    # real sizes: the same trace rows, 16x the tokens of the 32-token blocks
    real, scaled = by_name["mooncake_real_scale"], by_name["mooncake_conversation"]
    assert real.params["tokens_per_block"] == 512
    assert len(real.requests) <= len(scaled.requests)
    assert len(real.requests[0].prompt or "") > 10 * len(scaled.requests[0].prompt or "")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pinning_gives_the_routing_tier_its_own_cpu_and_restores_ours() -> None:
    # idle children that live until their stdin closes
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
                for _ in range(2)]
    try:
        worker, router = (c.pid for c in children)
        deployment = Deployment("cortex", "http://127.0.0.1:1", {"w0": "http://127.0.0.1:2"},
                                {"w0": worker, "gateway-0": router})
        mine = os.sched_getaffinity(0)
        split = cpu_split()
        assert split is not None
        with pinned(deployment):
            assert os.sched_getaffinity(router) == set(split["routing tier"])
            assert os.sched_getaffinity(worker) == set(split["workers and load generator"])
            assert os.sched_getaffinity(0) == set(split["workers and load generator"])
        assert os.sched_getaffinity(0) == mine
    finally:
        for c in children:
            assert c.stdin is not None
            c.stdin.close()  # the child's read returns: it exits
            c.wait(timeout=10)

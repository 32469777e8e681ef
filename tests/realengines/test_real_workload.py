"""Cortex (index, ingest, gateway) in front of two real vLLM engines: a random multi-turn chat
workload where every request's prediction is checked against the engine's ``cached_tokens``,
through an ingest restart (replay from the engine's real ROUTER socket) and an engine killed
and started again (its ledger clears and refills; no over-prediction after)."""

from __future__ import annotations

import re

import pytest

from cortex.devcluster.cluster import LocalCluster
from cortex.edge.probes import http_call
from cortex.testing import wait_until
from cortex.testing.vllm_engines import VllmEngine

from .conftest import get_json
from .workload import ChatWorkload, EvictionWatch, Outcome, Settle, Tally, report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(900)]

LAG_BOUND_S = 0.1  # a bucket bound of the lag histograms: how many applies took longer

def ledger_of(cluster: LocalCluster, worker_id: str) -> str:
    listing = get_json(cluster.gateway_urls[0] + "/admin/workers",
                       {"Authorization": f"Bearer {cluster.admin_token}"})
    return str({w["id"]: w["ledger"] for w in listing["workers"]}.get(worker_id, "absent"))


def ingest_counter(cluster: LocalCluster, name: str, label: str = "") -> float:
    """The sum of ingest's ``cortex_ingest_<name>_total`` samples whose labels hold ``label``."""
    assert cluster.ingest_url is not None
    pattern = rf"^cortex_ingest_{name}_total(?:\{{([^}}]*)\}})? (\S+)$"
    status, text = http_call(cluster.ingest_url + "/metrics")
    assert status == 200 and isinstance(text, str)
    return sum(float(value) for labels, value in re.findall(pattern, text, re.MULTILINE)
               if label in labels)


def lag_over(url: str, histogram: str, seconds: float = LAG_BOUND_S) -> dict[str, float]:
    """How many of a ``/metrics`` histogram's observations took more than ``seconds`` (one
    of its bucket bounds), of all."""
    status, text = http_call(url)
    assert status == 200 and isinstance(text, str)
    buckets = {float(le): float(v) for le, v in re.findall(
        rf'^{histogram}_bucket\{{le="([^"]+)"\}} (\S+)$', text, re.MULTILINE)}
    if not buckets:
        return {"observed": 0.0, f"over_{seconds}s": 0.0}
    total = buckets[float("inf")]
    return {"observed": total, f"over_{seconds}s": total - buckets[seconds]}


def report_lags(cluster: LocalCluster, phase: str) -> None:
    """The event path's measured lags so far: engine stamp → ingest applied, and index
    applied → this gateway's replica applied (counts over :data:`LAG_BOUND_S`)."""
    assert cluster.ingest_url is not None
    report(f"{phase}_lags", {
        "ingest": lag_over(cluster.ingest_url + "/metrics", "cortex_ingest_lag_seconds"),
        "replica": lag_over(cluster.gateway_urls[0] + "/metrics",
                            "cortex_gateway_replica_lag_seconds")})


def ingest_ledger(cluster: LocalCluster, worker_id: str) -> float:
    """Blocks in the ingest's ledger of ``worker_id`` (rank 0, device)."""
    assert cluster.ingest_url is not None
    status, text = http_call(cluster.ingest_url + "/metrics")
    assert status == 200 and isinstance(text, str)
    found = re.findall(r'^cortex_ingest_ledger_blocks\{([^}]*)\} (\S+)$', text, re.MULTILINE)
    return sum(float(v) for labels, v in found
               if f'worker="{worker_id}"' in labels and 'dp_rank="0"' in labels)


def ledger_matches_engine(cluster: LocalCluster, watch: EvictionWatch, worker_id: str,
                          phase: str) -> list[str]:
    """Once the cluster is idle, the ingest's ledger of a worker the watch saw from its
    start holds as many blocks as the engine published it holds (a stale block would make
    it larger); reported either way."""
    try:
        wait_until(lambda: ingest_ledger(cluster, worker_id) == watch.held_blocks(worker_id),
                   timeout=5, interval=0.1, what=f"{worker_id}'s ledger to match its engine")
    except TimeoutError:
        pass  # reported below
    engine, ingest = watch.held_blocks(worker_id), ingest_ledger(cluster, worker_id)
    report(f"{phase}_ledger_{worker_id}", {"engine": engine, "ingest": ingest})
    if ingest != engine:
        return [f"{phase}: {worker_id}'s ledger holds {ingest:.0f} blocks, its engine "
                f"published {engine} held"]
    return []


def problems(tally: Tally, phase: str, watch: EvictionWatch) -> list[str]:
    """What is wrong with a phase (failed requests, a ledger that did not settle, an
    over-prediction not explained by an eviction the settle could not cover), each in full;
    its numbers are reported either way, so every phase runs and is measured. The share of
    exact predictions is judged over the whole workload (:func:`too_few_exact`)."""
    summary = tally.summary()
    in_flight = [o for o in tally.over if watch.in_flight(o)]
    # requests sent while removals of their worker that the settle did not cover were
    # stamped before them (turn, worker, predicted, cached, blocks): how exposed the phase
    # was to evictions no router can have seen
    exposed = [(o.turn, o.worker, o.predicted, o.cached, blocks) for o in tally.outcomes
               if (blocks := watch.uncovered(o))]
    report(phase, {**summary, "over_in_flight": [describe(o, watch) for o in in_flight],
                   "exposed": exposed})
    found = [f"{phase}: failed {f}" for f in tally.failures]
    found += [f"{phase}: turn {o.turn}: the ledger did not settle in time ({o.settled})"
              for o in tally.outcomes if o.settled is not None and o.settled.timed_out]
    found += [f"{phase}: {describe(o, watch)}" for o in tally.over if o not in in_flight]
    return found


def too_few_exact(phases: list[Tally]) -> list[str]:
    """Fewer than 99 % of the phases' requests predicted exactly (issue 28's bound, over the
    workload's ≥ 150 requests: judged per 80-request phase, one eviction the engine published
    after the request was sent would already break it)."""
    exact = sum(t.exact for t in phases)
    total = sum(len(t.outcomes) for t in phases)
    report("exact", {"exact": exact, "requests": total})
    return [f"{exact} of {total} requests exact"] if exact < 0.99 * total else []


def describe(outcome: Outcome, watch: EvictionWatch) -> str:
    """An over-prediction with everything a diagnosis starts from: the outcome (match mode
    and reason, request id for the gateway's log) and its worker's removals around it."""
    return (f"over-predicted by {outcome.predicted - outcome.cached} tokens: {outcome}; "
            f"its worker's removals (s before it was sent: arrived, engine-stamped; blocks): "
            f"{watch.recent(outcome)}")


def fail_on(found: list[str]) -> None:
    """Fail with every problem on its own line (an ``assert found == []`` diff is cut
    short by pytest), and add them to the run's report."""
    report("problems", {"count": len(found), "problems": found})
    if found:
        pytest.fail(f"{len(found)} problem(s):\n" + "\n".join(found), pytrace=False)


def test_random_chat_workload_is_predicted_exactly(
    cluster: LocalCluster, engines: list[VllmEngine],
) -> None:
    watch = EvictionWatch({f"vllm-{i}": f"tcp://127.0.0.1:{e.events_port}"
                           for i, e in enumerate(engines)})
    try:
        _workload(cluster, engines, watch)
    finally:
        watch.close()


def _workload(cluster: LocalCluster, engines: list[VllmEngine], watch: EvictionWatch) -> None:
    workload = ChatWorkload(cluster.gateway_urls[0], "tiny-qwen", conversations=32,
                            admin_token=cluster.admin_token)
    assert cluster.ingest_url is not None
    settle = Settle(watch, cluster.ingest_url + "/metrics",
                    cluster.state()["index"]["metrics_url"])
    workload.settle = settle  # each request waits until the ledger holds what was published
    workload.run(80)
    warm = workload.tally
    found = problems(warm, "warm", watch)
    report_lags(cluster, "warm")
    assert sum(o.cached for o in warm.outcomes) > 0
    assert len(warm.summary()["by_worker"]) == 2  # both engines served
    evicted = ingest_counter(cluster, "blocks", 'op="removed"')
    report("warm_evictions", {"blocks_removed": evicted})
    assert evicted > 0, "the workload must push the engines' caches into eviction"

    # ingest restarted mid-workload: it replays what it missed from each engine's ROUTER
    cluster.kill("ingest")
    workload.tally = Tally()
    workload.settle = None  # nothing applies events now: no settle, no allowance
    workload.run(5)  # events published while nobody listens
    outage = workload.tally
    # not asserted: for the index's ingest grace (5 s, docs/index.md "Ingest liveness") a
    # dead ingest's ledgers keep their credit, so an eviction meanwhile can be over-predicted
    report("during_ingest_outage", {**outage.summary(),
                                    "over": [describe(o, watch) for o in outage.over]})
    found += [f"during_ingest_outage: failed {f}" for f in outage.failures]
    cluster.restart("ingest")
    cluster.wait_ready(timeout_s=60)
    workload.tally = Tally()
    workload.settle = settle
    workload.run(45)
    after_ingest = workload.tally
    found += problems(after_ingest, "after_ingest_restart", watch)
    assert ingest_counter(cluster, "replays") > 0  # the fresh ingest asked the ROUTERs

    # an engine killed and started again on the same ports: an empty cache, seq from 0
    victim = engines[1]
    victim.kill()
    watch.restarted("vllm-1")
    workload.tally = Tally()
    workload.run(10)  # routed to the survivor
    victim.start()
    wait_until(lambda: ledger_of(cluster, "vllm-1") == "ready", timeout=60, interval=0.2,
               what="the restarted engine's ledger to be ready again")
    workload.run(60)
    after = workload.tally
    found += problems(after, "after_engine_restart", watch)
    found += ledger_matches_engine(cluster, watch, "vllm-1", "after_engine_restart")
    report_lags(cluster, "after_engine_restart")
    report("engine_restart", {"startup_s": victim.startup_s})
    assert any(o.worker == "vllm-1" for o in after.outcomes[10:]), after.summary()
    fail_on(found + too_few_exact([warm, after_ingest, after]))

"""Pods → worker specs, the pod table's event handling and the reconcile plan (pure)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cortex.hashing import Engine
from cortex.registry import Listing, Tombstone, WorkerRole, WorkerSpec
from cortex.registry.kubernetes import REMOVAL_REASON, NotWorker, PodTable, plan, worker_of

BY = "kubernetes:llm:cortex/engine"


def pod(name: str = "sglang-0", *, ip: str | None = "10.0.0.5", ready: bool = True,
        phase: str = "Running", version: str = "100", labels: dict[str, str] | None = None,
        **annotations: str) -> dict[str, Any]:
    notes = {"cortex/model": "meta-llama/Llama-3.1-8B", "cortex/kv-events-port": "5557",
             **{k.replace("_", "-"): v for k, v in annotations.items()}}
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "llm", "resourceVersion": version,
                         "uid": f"uid-{name}",
                         "labels": {"app": "sglang", "cortex/engine": "sglang",
                                    **(labels or {})},
                         "annotations": {f"cortex/{k.removeprefix('cortex/')}": v
                                         for k, v in notes.items()}},
            "spec": {"nodeName": "gpu-node-3", "containers": [{"name": "engine"}]},
            "status": status}


def test_a_ready_pod_is_the_worker_its_annotations_describe() -> None:
    spec = worker_of(pod(replay_port="5558", block_size="16", dp_size="2", topic="kv"), BY)
    assert spec == WorkerSpec(
        id="sglang-0.llm", url="http://10.0.0.5:30000", engine=Engine.SGLANG,
        model="meta-llama/Llama-3.1-8B", kv_events="tcp://10.0.0.5:5557",
        replay="tcp://10.0.0.5:5558", block_size=16, dp_size=2, topic="kv",
        labels={"source": "kubernetes", "k8s.namespace": "llm", "k8s.pod": "sglang-0",
                "k8s.node": "gpu-node-3", "discovered-by": BY})


def test_engine_default_ports_roles_labels_and_ipv6() -> None:
    spec = worker_of(pod(ip="fd00::7", engine="vllm", port="8100", role="decode"))
    assert isinstance(spec, WorkerSpec)
    assert spec.engine is Engine.VLLM and spec.role is WorkerRole.DECODE  # annotation wins
    assert spec.url == "http://[fd00::7]:8100" and spec.kv_events == "tcp://[fd00::7]:5557"
    vllm = worker_of(pod(labels={"cortex/engine": "vllm"}))
    assert isinstance(vllm, WorkerSpec) and vllm.url == "http://10.0.0.5:8000"
    prefill = worker_of(pod(role="prefill", bootstrap_port="8998"))
    assert isinstance(prefill, WorkerSpec) and prefill.bootstrap_port == 8998


@pytest.mark.parametrize(("change", "reason"), [
    ({"ready": False}, "not Ready"),
    ({"phase": "Pending"}, "phase Pending"),
    ({"ip": None}, "no pod IP"),
])
def test_a_pod_that_cannot_take_requests_is_no_worker(change: dict[str, Any],
                                                      reason: str) -> None:
    assert worker_of(pod(**change)) == NotWorker("sglang-0", reason)
    terminating = pod()
    terminating["metadata"]["deletionTimestamp"] = "2026-12-02T01:00:00Z"
    assert worker_of(terminating) == NotWorker("sglang-0", "terminating")


@pytest.mark.parametrize(("annotations", "message"), [
    ({"model": ""}, "cortex/model: missing"),
    ({"engine": "tgi"}, "unknown engine 'tgi'"),
    ({"port": "http"}, "cortex/port: 'http' is not a port"),
    ({"kv_events_port": "70000"}, "is not a port"),
    ({"block_size": "sixteen"}, "cortex/block-size: 'sixteen' is not a number"),
    ({"role": "leader"}, "unknown role 'leader'"),
    ({"bootstrap_port": "8998"}, "bootstrap_port: applies only to SGLang prefill workers"),
])
def test_wrong_annotations_make_an_invalid_pod_never_a_guess(
    annotations: dict[str, str], message: str,
) -> None:
    outcome = worker_of(pod(**annotations))
    assert isinstance(outcome, NotWorker) and outcome.invalid, outcome
    assert message in outcome.reason
    # wrong even when not ready: the operator learns of it before the pod is needed
    assert isinstance(worker := worker_of(pod(ready=False, **annotations)), NotWorker)
    assert worker.invalid


def test_the_table_follows_list_then_events_and_never_rolls_back() -> None:
    table = PodTable(BY)
    table.reset([pod("a"), pod("b", ready=False)], "100")
    assert set(table.workers()) == {"a.llm"} and table.resource_version == "100"
    assert table.apply("MODIFIED", pod("b", version="101")) is True
    assert set(table.workers()) == {"a.llm", "b.llm"}
    stale = pod("b", ready=False, version="99")  # re-delivered after a reconnect
    assert table.apply("MODIFIED", stale) is False and "b.llm" in table.workers()
    assert table.apply("MODIFIED", pod("b", version="101")) is False  # the same pod again
    bookmark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "150"}}
    assert table.apply("BOOKMARK", bookmark) is False and table.resource_version == "150"
    assert table.apply("DELETED", pod("a", version="151")) is True
    assert table.apply("DELETED", pod("a", version="152")) is False
    assert set(table.workers()) == {"b.llm"} and table.resource_version == "152"
    moved = pod("b", ip="10.0.0.9", version="160")
    assert table.apply("MODIFIED", moved) is True
    assert table.workers()["b.llm"].url == "http://10.0.0.9:30000"
    table.reset([], "200")
    assert table.workers() == {} and len(table) == 0


def spec_of(name: str, **changes: str) -> WorkerSpec:
    spec = worker_of(pod(name, **changes), BY)
    assert isinstance(spec, WorkerSpec)
    return spec


def test_plan_registers_new_and_changed_renews_the_rest_and_removes_its_own() -> None:
    a, b, c = spec_of("a"), spec_of("b"), spec_of("c")
    moved = spec_of("b", block_size="32")
    operator = WorkerSpec(id="static-0", url="http://10.9.9.9:30000", engine=Engine.SGLANG,
                          model="m")
    other_discovery = a.with_changes(id="x.llm", labels={**a.labels, "discovered-by": "other"})
    listing = Listing(workers={a.id: a, b.id: b, c.id: c, operator.id: operator,
                               other_discovery.id: other_discovery})
    todo = plan({a.id: a, b.id: moved}, listing, BY)
    assert todo.register == (moved,) and todo.renew == (a,)
    assert todo.remove == ("c.llm",) and todo.held == ()  # never the others' workers
    assert todo


def test_plan_respects_an_operators_removal_but_not_its_own() -> None:
    a, b = spec_of("a"), spec_of("b")
    listing = Listing(tombstones={
        a.id: Tombstone(a.id, reason="drained by ops"),
        b.id: Tombstone(b.id, reason=REMOVAL_REASON),  # the pod was not ready; now it is
    })
    todo = plan({a.id: a, b.id: b}, listing, BY)
    assert todo.held == ("a.llm",) and todo.register == (b,)


def test_plan_tombstones_a_pod_that_left_after_its_lease_lapsed() -> None:
    a = spec_of("a")
    assert plan({}, Listing(), BY, previous={a.id}).remove == ("a.llm",)
    done = Listing(tombstones={a.id: Tombstone(a.id, reason=REMOVAL_REASON)})
    assert plan({}, done, BY, previous={a.id}).remove == ()
    assert not plan({a.id: a}, Listing(workers={a.id: a}), BY)  # nothing to write


def test_a_pod_object_is_not_mutated() -> None:
    original = pod()
    kept = copy.deepcopy(original)
    table = PodTable(BY)
    table.reset([original], "1")
    table.workers()
    assert original == kept


def test_what_the_engine_said_fills_in_what_the_pod_does_not() -> None:
    bare = pod()
    bare["metadata"]["annotations"] = {"cortex/block-size": "32"}  # the pod's word wins
    learned = {"engine": Engine.SGLANG, "model": "Qwen/Qwen3-8B", "block_size": 16,
               "kv_events": "tcp://10.0.0.5:6000", "replay": "tcp://10.0.0.5:6001",
               "dp_size": 2, "topic": "kv", "bootstrap_port": 8998,
               "role": WorkerRole.REGULAR, "context_length": 32768}
    spec = worker_of(bare, BY, learned)
    assert isinstance(spec, WorkerSpec), spec
    assert (spec.model, spec.block_size, spec.dp_size, spec.topic) == ("Qwen/Qwen3-8B", 32, 2,
                                                                       "kv")
    assert spec.kv_events == "tcp://10.0.0.5:6000" and spec.replay == "tcp://10.0.0.5:6001"
    assert spec.bootstrap_port is None  # a learned default of SGLang prefills only
    prefill = worker_of(bare, BY, {**learned, "role": WorkerRole.PREFILL})
    assert isinstance(prefill, WorkerSpec) and prefill.bootstrap_port == 8998
    nothing = worker_of(bare, BY, {})
    assert isinstance(nothing, NotWorker) and "cortex/model: missing" in nothing.reason

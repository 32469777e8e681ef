"""``Admit``, the one validation of every entry: the model's bounds come from its config,
else from the smallest context length its workers' engines reported; adapters from the
workers' lists (a real pool, pure)."""

from __future__ import annotations

import pytest

from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.fleet.pool import WorkerPool
from cortex.gateway.request.payload import Admit, InferencePath, Limits
from cortex.hashing import Engine
from cortex.registry import WorkerSpec

pytestmark = pytest.mark.timeout(10)

CONFIG = GatewayConfig.from_mapping({"models": [
    {"name": "learned", "engine": "sglang"},
    {"name": "fixed", "engine": "sglang", "max_model_len": 100},
]})


def admitted(context_lengths: dict[str, int | None]) -> Admit:
    pool = WorkerPool(CONFIG.breaker)
    pool.sync({worker: WorkerSpec(id=worker, url=f"http://127.0.0.1:{9000 + i}",
                                  engine=Engine.SGLANG, model=model)
               for i, (worker, model) in enumerate([("a", "learned"), ("b", "learned"),
                                                    ("c", "fixed")])})
    for worker in pool:
        worker.context_length = context_lengths.get(worker.id)
    next(w for w in pool if w.id == "b").adapters = frozenset({"sql"})
    return Admit(CONFIG, pool.context_length, pool.adapter_base)


def chat(model: str, text: str = "hi") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


def test_the_bounds_are_the_smallest_reported_context_unless_configured() -> None:
    admit = admitted({"a": 4096, "b": 2048, "c": 8192})
    learned, fixed = CONFIG.models
    assert admit.limits(learned) == Limits(2047, 2048, 2048)
    assert admit.limits(fixed) == Limits(99, 100, 100)  # max_model_len wins
    assert admitted({}).limits(learned) == Limits()  # nobody reported: unbounded


def test_admit_checks_the_learned_bound_and_resolves_the_workers_adapters() -> None:
    admit = admitted({"a": 64, "b": 64})
    assert admit(InferencePath.CHAT, chat("learned")).model.name == "learned"
    with pytest.raises(ClientError) as over:
        admit(InferencePath.CHAT, chat("learned", "word " * 1000))
    assert over.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert admit(InferencePath.CHAT, chat("sql")).model.name == "learned"

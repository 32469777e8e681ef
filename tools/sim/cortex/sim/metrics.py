"""The engines' Prometheus metrics, rendered from a load snapshot (all names in one place).

vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0 to 1; ``vllm:gpu_cache_usage_perc`` before 0.11), counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens), prompt / generation
tokens and finished requests; labels ``model_name`` and ``engine``. SGLang (``sglang:``):
``num_running_reqs``, ``num_queue_reqs``, ``token_usage``, ``cache_hit_rate`` and token
counters; label ``model_name``. With data parallelism vLLM reports one series per engine
core (``engine="0"``, ``engine="1"``…); SGLang is rendered as the sum over its ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cortex.hashing import Engine

__all__ = ["LoadSnapshot", "render_metrics", "restrict"]


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What a worker reports about its load; token counts in tokens, usage in [0, 1]."""

    running: int
    waiting: int
    kv_usage: float
    used_tokens: int
    total_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prompt_tokens: int
    generation_tokens: int
    finished_requests: int

    @property
    def cache_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    @classmethod
    def total(cls, loads: Sequence[LoadSnapshot]) -> LoadSnapshot:
        """The sum over data-parallel ranks (``kv_usage`` over the pooled capacity)."""
        if len(loads) == 1:
            return loads[0]
        used = sum(load.used_tokens for load in loads)
        total = sum(load.total_tokens for load in loads)
        return cls(
            running=sum(load.running for load in loads),
            waiting=sum(load.waiting for load in loads),
            kv_usage=used / total if total else 0.0,
            used_tokens=used, total_tokens=total,
            prefix_query_tokens=sum(load.prefix_query_tokens for load in loads),
            prefix_hit_tokens=sum(load.prefix_hit_tokens for load in loads),
            prompt_tokens=sum(load.prompt_tokens for load in loads),
            generation_tokens=sum(load.generation_tokens for load in loads),
            finished_requests=sum(load.finished_requests for load in loads),
        )


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(engine: Engine, version: tuple[int, ...], model: str,
                   loads: Sequence[LoadSnapshot]) -> str:
    """The ``/metrics`` text exposition of ``engine`` at ``version``; ``loads``: one per
    data-parallel rank."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, values: Sequence[tuple[str, float]]
               ) -> None:
        sample = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {sample} {help_text}")
        lines.append(f"# TYPE {sample} {kind}")
        for labels, value in values:
            lines.append(f"{sample}{{{labels}}} {float(value)!r}")

    if engine is Engine.VLLM:
        per = [(f'engine="{rank}",model_name="{_esc(model)}"', load)
               for rank, load in enumerate(loads)]

        def each(field: str, extra: str = "") -> list[tuple[str, float]]:
            return [(labels + extra, getattr(load, field)) for labels, load in per]

        metric("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", each("running"))
        metric("vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", each("waiting"))
        usage_name = "vllm:kv_cache_usage_perc" if version >= (0, 11) else (
            "vllm:gpu_cache_usage_perc")
        metric(usage_name, "gauge", "KV-cache usage. 1 means 100 percent usage.",
               each("kv_usage"))
        metric("vllm:prefix_cache_queries", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               each("prefix_query_tokens"))
        metric("vllm:prefix_cache_hits", "counter",
               "Prefix cache hits, in terms of number of cached tokens.",
               each("prefix_hit_tokens"))
        metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
               each("prompt_tokens"))
        metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
               each("generation_tokens"))
        metric("vllm:request_success", "counter", "Count of successfully processed requests.",
               each("finished_requests", ',finished_reason="stop"'))
    else:
        load = LoadSnapshot.total(loads)
        labels = f'model_name="{_esc(model)}"'
        metric("sglang:num_running_reqs", "gauge", "The number of running requests.",
               [(labels, load.running)])
        metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
               [(labels, load.waiting)])
        metric("sglang:num_used_tokens", "gauge", "The number of used tokens.",
               [(labels, load.used_tokens)])
        metric("sglang:token_usage", "gauge", "The token usage.",
               [(labels, load.kv_usage)])
        metric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.",
               [(labels, load.cache_hit_rate)])
        metric("sglang:prompt_tokens", "counter", "Number of prefill tokens processed.",
               [(labels, load.prompt_tokens)])
        metric("sglang:generation_tokens", "counter", "Number of generation tokens processed.",
               [(labels, load.generation_tokens)])
        metric("sglang:cached_tokens", "counter", "Number of cached prompt tokens.",
               [(labels, load.prefix_hit_tokens)])
        metric("sglang:num_requests", "counter", "The number of processed requests.",
               [(labels, load.finished_requests)])
    return "\n".join(lines) + "\n"


def restrict(text: str, names: Sequence[str]) -> str:
    """``text`` (an exposition) with only the samples named in ``names``, each family's
    ``HELP`` / ``TYPE`` lines kept with its samples: what prometheus_client's ASGI app answers
    to ``?name[]=…`` (vLLM's ``/metrics/`` mount). Sample names: a counter's end in
    ``_total``."""
    wanted = set(names)
    out: list[str] = []
    family: list[str] = []  # the current family's HELP / TYPE lines, until a sample is kept
    for line in text.splitlines():
        if line.startswith("# "):
            if line.startswith("# HELP "):
                family = []
            family.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out.extend(family)
            family = []
            out.append(line)
    return "\n".join(out) + "\n" if out else ""

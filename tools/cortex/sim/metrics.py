"""The engines' Prometheus metrics, rendered from a load snapshot (all names in one place).

vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0 to 1; ``vllm:gpu_cache_usage_perc`` before 0.11), counters
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens), prompt / generation
tokens and finished requests; labels ``model_name`` and ``engine``. SGLang (``sglang:``):
``num_running_reqs``, ``num_queue_reqs``, ``token_usage``, ``cache_hit_rate`` and token
counters; label ``model_name``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex.hashing import Engine

__all__ = ["LoadSnapshot", "render_metrics"]


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


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(engine: Engine, version: tuple[int, ...], model: str, load: LoadSnapshot
                   ) -> str:
    """The ``/metrics`` text exposition of ``engine`` at ``version``."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: str) -> None:
        sample = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {sample} {help_text}")
        lines.append(f"# TYPE {sample} {kind}")
        lines.append(f"{sample}{{{labels}}} {float(value)!r}")

    if engine is Engine.VLLM:
        labels = f'engine="0",model_name="{_esc(model)}"'
        metric("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", load.running, labels)
        metric("vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", load.waiting, labels)
        usage_name = "vllm:kv_cache_usage_perc" if version >= (0, 11) else (
            "vllm:gpu_cache_usage_perc")
        metric(usage_name, "gauge", "KV-cache usage. 1 means 100 percent usage.",
               load.kv_usage, labels)
        metric("vllm:prefix_cache_queries", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               load.prefix_query_tokens, labels)
        metric("vllm:prefix_cache_hits", "counter",
               "Prefix cache hits, in terms of number of cached tokens.",
               load.prefix_hit_tokens, labels)
        metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
               load.prompt_tokens, labels)
        metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
               load.generation_tokens, labels)
        metric("vllm:request_success", "counter", "Count of successfully processed requests.",
               load.finished_requests, labels + ',finished_reason="stop"')
    else:
        labels = f'model_name="{_esc(model)}"'
        metric("sglang:num_running_reqs", "gauge", "The number of running requests.",
               load.running, labels)
        metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
               load.waiting, labels)
        metric("sglang:num_used_tokens", "gauge", "The number of used tokens.",
               load.used_tokens, labels)
        metric("sglang:token_usage", "gauge", "The token usage.", load.kv_usage, labels)
        metric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.",
               load.cache_hit_rate, labels)
        metric("sglang:prompt_tokens", "counter", "Number of prefill tokens processed.",
               load.prompt_tokens, labels)
        metric("sglang:generation_tokens", "counter", "Number of generation tokens processed.",
               load.generation_tokens, labels)
        metric("sglang:cached_tokens", "counter", "Number of cached prompt tokens.",
               load.prefix_hit_tokens, labels)
        metric("sglang:num_requests", "counter", "The number of processed requests.",
               load.finished_requests, labels)
    return "\n".join(lines) + "\n"

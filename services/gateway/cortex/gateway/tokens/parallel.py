"""Encoding never-seen prompt text on several cores (the async shell around encode plans).

An :class:`~cortex.gateway.tokens.prompt.EncodePlan`'s missing pieces are partitioned into up to
``workers`` contiguous groups of about equal length and encoded concurrently:

- ``threads`` (the default): one thread per group, each calling ``encode_batch`` one piece
  at a time; the tokenizer releases the GIL while it encodes, so the groups run on separate
  cores and the event loop keeps running. The thread that finishes the last group assembles
  the ids and fills the cache.
- ``processes``: each group goes to a worker process holding its own copy of the tokenizer
  (pieces and ids are pickled both ways); the ids are assembled on the event loop.

``cortex bench tokenize`` measures both (docs/bench/tokenize.md): threads win on this
machine, processes cost a copy of the tokenizer per worker and the pickling.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from array import array
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path

from cortex.chat import load_tokenizer
from cortex.gateway.tokens.prompt import EncodePlan, PromptTokenizer

__all__ = ["EncoderMode", "ParallelEncoder", "partition"]


class EncoderMode(StrEnum):
    THREADS = "threads"
    PROCESSES = "processes"


def partition(texts: Sequence[tuple[str, bool]], groups: int) -> list[range]:
    """Up to ``groups`` contiguous, non-empty index ranges of ``texts`` with about equal
    characters each (fewer when there are fewer texts)."""
    count = len(texts)
    if not count:
        return []
    groups = max(1, min(groups, count))
    if groups == 1:
        return [range(count)]
    total = sum(len(text) for text, _ in texts)
    out: list[range] = []
    start = 0
    acc = 0
    for i, (text, _) in enumerate(texts):
        acc += len(text)
        left = count - i - 1  # texts after this one
        wanted = groups - len(out) - 1  # ranges still to open after this one
        if wanted and (acc * groups >= total * (len(out) + 1) or left == wanted):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, count))
    return [r for r in out if len(r)]


class _Fanout:
    """One plan's groups on the thread pool; the last group to finish assembles."""

    def __init__(self, tokenizer: PromptTokenizer, plan: EncodePlan, groups: list[range]
                 ) -> None:
        self.tokenizer = tokenizer
        self.plan = plan
        self.groups = groups
        self.results: list[list[list[int]]] = [[] for _ in groups]
        self._left = len(groups)
        self._lock = threading.Lock()

    def run(self, index: int) -> array[int] | None:
        missing = self.plan.missing
        self.results[index] = self.tokenizer.encode_pieces(
            [missing[i] for i in self.groups[index]])
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return None
        return self.plan.finish([ids for group in self.results for ids in group])


_CHILD_TOKENIZERS: dict[str, object] = {}


def _child_encode(source: str | None, texts: list[tuple[str, bool]]) -> list[list[int]]:
    """In a worker process: the ids of ``texts`` with the tokenizer at ``source``."""
    tok = _CHILD_TOKENIZERS.get(source or "")
    if tok is None:
        tok = _CHILD_TOKENIZERS[source or ""] = load_tokenizer(source)
    encode = tok.encode_batch  # type: ignore[attr-defined]
    return [encode([text], add_special_tokens=special)[0].ids for text, special in texts]


class ParallelEncoder:
    """Finishes encode plans on ``workers`` cores (threads or processes, see the module).

    ``sources``: model name → its ``tokenizer.json`` path (``None``: the default tokenizer),
    what a worker process loads. Thread-safe to call from the event loop only.
    """

    def __init__(self, workers: int, mode: EncoderMode = EncoderMode.THREADS,
                 sources: Mapping[str, Path | None] | None = None) -> None:
        self.workers = max(1, workers)
        self.mode = EncoderMode(mode)
        self._sources = dict(sources or {})
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix="cortex-tokenize")
        self._processes: concurrent.futures.ProcessPoolExecutor | None = None

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._processes is None:
            # spawn: a forked child would inherit the tokenizer's thread pool state
            self._processes = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._processes

    async def warm(self, model: str) -> None:
        """Start the worker processes and load ``model``'s tokenizer in each (processes
        mode; a no-op with threads)."""
        if self.mode is EncoderMode.PROCESSES:
            loop = asyncio.get_running_loop()
            source = self._source(model)
            await asyncio.gather(*(loop.run_in_executor(self._pool(), _child_encode, source,
                                                        [("warm", False)])
                                   for _ in range(self.workers)))

    async def warm_threads(self, warm: Callable[[], None]) -> None:
        """Run ``warm`` once on each of the ``workers`` threads (they meet at a barrier, so
        no thread takes two); a no-op with processes, which encode with their own copy."""
        if self.mode is EncoderMode.PROCESSES:
            return
        loop = asyncio.get_running_loop()
        barrier = threading.Barrier(self.workers)

        def each() -> None:
            barrier.wait(timeout=30)
            warm()

        await asyncio.gather(*(loop.run_in_executor(self._threads, each)
                               for _ in range(self.workers)))

    def _source(self, model: str) -> str | None:
        path = self._sources.get(model)
        return None if path is None else str(path)

    async def finish(self, model: str, tokenizer: PromptTokenizer, plan: EncodePlan
                     ) -> array[int]:
        """``plan``'s ids, its missing pieces encoded off the event loop in parallel."""
        if not plan.missing:
            return plan.finish([])
        loop = asyncio.get_running_loop()
        groups = partition(plan.missing, self.workers)
        if self.mode is EncoderMode.PROCESSES:
            source = self._source(model)
            missing = plan.missing
            parts = await asyncio.gather(*(
                loop.run_in_executor(self._pool(), _child_encode, source,
                                     [missing[i] for i in group]) for group in groups))
            return plan.finish([ids for part in parts for ids in part])
        fanout = _Fanout(tokenizer, plan, groups)
        outs = await asyncio.gather(*(loop.run_in_executor(self._threads, fanout.run, i)
                                      for i in range(len(groups))))
        return next(out for out in outs if out is not None)

    def close(self) -> None:
        """Stop the workers (waits for running encodes)."""
        self._threads.shutdown(wait=True, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown(wait=True, cancel_futures=True)

    def __repr__(self) -> str:
        return f"ParallelEncoder(workers={self.workers}, mode={self.mode.value})"

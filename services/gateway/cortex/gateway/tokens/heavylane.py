"""Huge chat requests rendered and tokenized in worker processes (never on the event loop).

Jinja rendering and splitting a prompt are Python work that holds the GIL: on a worker
thread they would still take turns with the event loop (measured: a 20,000-message render
on a thread delayed small requests by up to 45 ms). Requests past the ``heavy`` bounds
(:class:`~cortex.gateway.config.gateway.TokenizeConfig`) therefore go to one of ``workers`` spawned
processes, each with its own tokenizers and segment caches. A conversation keeps its
process (chosen by a hash of its first message), so its later turns and its fed answers hit
that process's cache. Processes start on first use (about a second each).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cortex.chat import EncoderChoice, RenderArgs
from cortex.gateway.tokens.prompt import PromptTokenizer

__all__ = ["HeavyLane", "TokenizerSpec"]


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What a worker process loads for a model (paths ``None``: the defaults)."""

    tokenizer: Path | None
    chat_template: Path | None
    cache_tokens: int
    cache_bytes: int
    encoder: EncoderChoice = EncoderChoice.HF  # the parent's result: no probe is repeated


_CHILD: dict[TokenizerSpec, PromptTokenizer] = {}


def _child_tokenizer(spec: TokenizerSpec) -> PromptTokenizer:
    tok = _CHILD.get(spec)
    if tok is None:
        tok = _CHILD[spec] = PromptTokenizer.load(spec.tokenizer, spec.chat_template,
                                                  spec.cache_tokens, spec.cache_bytes,
                                                  spec.encoder)
    return tok


def _child_tokens(spec: TokenizerSpec, args: RenderArgs) -> bytes:
    """In a worker process: the prompt ids of ``args`` as packed ``uint32``."""
    tok = _child_tokenizer(spec)
    return array("I", tok.encode_prompt(tok.prompt(args))).tobytes()


class HeavyLane:
    """``workers`` single-process pools; see the module. Call from the event loop."""

    def __init__(self, workers: int, specs: Mapping[str, TokenizerSpec]) -> None:
        self.specs = dict(specs)
        self._pools: list[concurrent.futures.ProcessPoolExecutor | None] = [None] * max(1,
                                                                                     workers)

    def _pool(self, args: RenderArgs) -> concurrent.futures.ProcessPoolExecutor:
        first = str(args.messages[0].get("content", "")) if args.messages else ""
        slot = zlib.crc32(first[:65536].encode("utf-8", "surrogatepass")) % len(self._pools)
        pool = self._pools[slot]
        if pool is None:
            pool = self._pools[slot] = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return pool

    async def tokens(self, model: str, args: RenderArgs) -> list[int]:
        """The prompt ids; raises :class:`cortex.chat.ChatError` like rendering does."""
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._pool(args), _child_tokens, self.specs[model],
                                          args)
        ids = array("I")
        ids.frombytes(data)
        return ids.tolist()

    def feed(self, model: str, args: RenderArgs) -> concurrent.futures.Future[bytes]:
        """Tokenize ``args`` in its conversation's process for the cache only."""
        return self._pool(args).submit(_child_tokens, self.specs[model], args)

    def close(self) -> None:
        for pool in self._pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def __repr__(self) -> str:
        started = sum(pool is not None for pool in self._pools)
        return f"HeavyLane(workers={len(self._pools)}, started={started})"

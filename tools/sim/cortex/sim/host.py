"""The simulated engine's host tier: a bounded LRU pool of blocks evicted from the GPU.

What both engines do with host offloading on (vLLM's CPU offloading connector, SGLang
HiCache): a block leaving GPU memory is kept in host memory; a later request whose prefix
continues there loads it back instead of recomputing it (cheaper, not free: see
:class:`cortex.sim.config.TimingConfig`). Pure and synchronous; the pool does not record
events itself (:class:`cortex.sim.cache.PrefixCache` does, with the tier named).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostBlock", "HostPool"]


@dataclass(frozen=True, slots=True)
class HostBlock:
    """One block in host memory: its engine event id, its parent's, its tokens."""

    event_id: int
    parent_event_id: int | None
    tokens: tuple[int, ...]
    lora: str | None = None


class HostPool:
    """``capacity`` blocks, least recently offloaded or loaded evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("host capacity must be >= 1 block")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, HostBlock] = OrderedDict()
        self.offloaded_blocks = 0
        self.loaded_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: object) -> bool:
        return digest in self._blocks

    def __repr__(self) -> str:
        return (f"HostPool(blocks={len(self._blocks)}/{self.capacity}, "
                f"offloaded={self.offloaded_blocks}, loaded={self.loaded_blocks})")

    def offload(self, digest: bytes, block: HostBlock) -> tuple[bool, list[HostBlock]]:
        """Keep ``block``; returns whether it is new here and the blocks evicted for room."""
        if digest in self._blocks:
            self._blocks.move_to_end(digest)
            return False, []
        evicted: list[HostBlock] = []
        while len(self._blocks) >= self.capacity:
            evicted.append(self._blocks.popitem(last=False)[1])
        self._blocks[digest] = block
        self.offloaded_blocks += 1
        self.evicted_blocks += len(evicted)
        return True, evicted

    def run(self, digests: Sequence[bytes], start: int, stop: int) -> int:
        """Blocks ``digests[start:stop]`` held here consecutively from ``start``; those are
        touched (they are about to be loaded back)."""
        n = start
        while n < stop and digests[n] in self._blocks:
            self._blocks.move_to_end(digests[n])
            n += 1
        self.loaded_blocks += n - start
        return n - start

    def clear(self) -> None:
        self._blocks.clear()

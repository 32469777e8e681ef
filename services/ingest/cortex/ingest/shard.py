"""``ShardSpec``: which workers one ingest process owns (``--shard i/K``).

A worker belongs to the shard with the highest rendezvous score ``xxh3_64(id, seed=j)`` over
``j`` in ``0..K-1``: stable across processes, machines and Python versions (unlike
``hash()``), every worker has exactly one owner, and growing K moves only about 1/K of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from cortex.ingest.errors import ConfigError

__all__ = ["ShardSpec", "shard_of"]


def shard_of(worker_id: str, count: int) -> int:
    """The shard (``0..count-1``) owning ``worker_id``."""
    data = worker_id.encode()
    best, owner = -1, 0
    for shard in range(count):
        score = xxhash.xxh3_64_intdigest(data, seed=shard)
        if score > best:
            best, owner = score, shard
    return owner


@dataclass(frozen=True, slots=True)
class ShardSpec:
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"shard {self.index}/{self.count}: need 0 <= i < K and K >= 1")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        """``"i/K"``, e.g. ``"0/2"``."""
        index, sep, count = text.partition("/")
        if not sep or not index.strip().isdigit() or not count.strip().isdigit():
            raise ConfigError(f"shard {text!r} must be i/K, e.g. 0/2")
        return cls(int(index), int(count))

    def owns(self, worker_id: str) -> bool:
        return self.count == 1 or shard_of(worker_id, self.count) == self.index

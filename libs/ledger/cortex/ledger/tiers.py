"""Tiered matching: how a worker's offload tiers extend its device prefix.

Both engines hit the device prefix first and then load what follows from their offload
tiers, block by block, until no tier holds the next block:

- vLLM (``v1/core/sched/scheduler.py``: local prefix-cache hit, then the KV connector's
  ``get_num_new_matched_tokens`` from that point; ``v1/kv_offload`` looks up the longest
  run of offloaded blocks starting there);
- SGLang HiCache (``mem_cache/hiradix_cache.py::match_prefix``: device nodes, then nodes
  evicted from the device but backed up on the host, then an L3 prefetch of the rest).

So a worker rank's effective prefix is ``D + R``: ``D`` its device prefix, ``R`` the run of
blocks after it that some READY offload tier (host, disk) of the same rank holds. A block
held in several tiers counts for the cheapest (host before disk). A device block *after*
the device prefix does not extend the run (vLLM's connector looks up offloaded blocks
only), so this never credits what the engine would recompute. The shared tier is not part
of it: it is a cluster-level cache (:attr:`cortex.ledger.match.Match.shared_blocks`).

Pure; ``held`` columns come from :meth:`RadixHashTree.held_columns`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from cortex.ledger.model import Tier

__all__ = ["OFFLOAD_TIERS", "continuation"]

OFFLOAD_TIERS = (Tier.HOST, Tier.DISK)
"""The tiers that extend one worker's prefix, cheapest first."""


def continuation(device_blocks: int, held: npt.NDArray[np.bool_],
                 tiers: Sequence[Tier]) -> list[int]:
    """Blocks each offload tier adds after a ``device_blocks`` prefix.

    ``held[i, j]``: tier ``tiers[j]`` holds query block ``i`` (rows: the leading query
    blocks the tree has). Returns per ``tiers[j]`` the blocks of the run credited to it.
    """
    counts = [0] * len(tiers)
    n = held.shape[0]
    if device_blocks >= n or not tiers:
        return counts
    tail = held[device_blocks:]
    any_held: npt.NDArray[np.bool_] = np.asarray(tail.any(axis=1))
    stop = int(np.argmin(any_held)) if not any_held.all() else int(any_held.size)
    if not stop:
        return counts
    run = tail[:stop]
    order = sorted(range(len(tiers)), key=lambda j: tiers[j])
    taken = np.zeros(stop, np.bool_)
    for j in order:
        mine = run[:, j] & ~taken
        counts[j] = int(np.count_nonzero(mine))
        taken |= mine
    return counts

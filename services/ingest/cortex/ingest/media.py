"""The engines' medium names → ledger tiers.

Names as the engines publish them (``medium`` of ``BlockStored`` / ``BlockRemoved``):

- vLLM: ``"GPU"`` (``v1/core/block_pool.py``), ``"CPU"`` (``v1/kv_offload/mediums.py``,
  the CPU offloading connector), ``"STORAGE"`` (storage offload backends);
- SGLang: ``"GPU"``, ``"CPU_PINNED"`` (HiCache host pool; some builds name it ``"CPU"``),
  ``"DISK"`` (HiCache file storage), ``"EXTERNAL"`` (a remote pool every instance reads:
  Mooncake, 3FS, ...), the names of ``disaggregation/kv_events.py::StorageMedium``.

A missing medium (engines before they had one) is device memory. Any other name is not
guessed: its blocks are counted as ignored (reason ``medium``). Matching ignores case, as
connectors of both engines have published lower-case names.
"""

from __future__ import annotations

from typing import Final

from cortex.ledger.model import Tier

__all__ = ["tier_of"]

_TIERS: Final[dict[str, Tier]] = {
    "gpu": Tier.DEVICE,
    "cuda": Tier.DEVICE,
    "cpu": Tier.HOST,
    "cpu_pinned": Tier.HOST,
    "storage": Tier.DISK,
    "disk": Tier.DISK,
    "external": Tier.SHARED,
}


def tier_of(medium: str | None) -> Tier | None:
    """The tier of an event's ``medium`` (``None``: a name Cortex does not know)."""
    if medium is None:
        return Tier.DEVICE
    return _TIERS.get(medium.lower())

"""The Cortex index: radix hash trees of who holds which KV block, served over gRPC.

Public API (imported lazily, so ``cortex.ledger.tree`` does not pull in grpclib)::

    from cortex.index import IndexConfig, IndexServer

    async with IndexServer(IndexConfig(host="127.0.0.1", port=0, metrics_port=None)) as srv:
        ...  # gRPC at srv.target; srv.index_id; srv.core is the live PrefixIndex
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cortex.index.config import IndexConfig
    from cortex.index.convert import match_args, match_reply
    from cortex.index.prefix_index import PrefixIndex
    from cortex.index.server import IndexServer
    from cortex.ledger.tree import RadixHashTree

__all__ = [
    "IndexConfig", "IndexServer", "PrefixIndex", "RadixHashTree", "match_args", "match_reply",
]

_WHERE = {
    "IndexConfig": "cortex.index.config",
    "IndexServer": "cortex.index.server",
    "PrefixIndex": "cortex.index.prefix_index",
    "RadixHashTree": "cortex.ledger.tree",
    "match_args": "cortex.index.convert",
    "match_reply": "cortex.index.convert",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'cortex.index' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

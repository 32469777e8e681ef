"""Which core the process's radix hash trees use: the compiled one (default) or pure Python.

The compiled core (:mod:`cortex.ledger.native`) is ~10-100x faster per block; the pure-Python
one (:mod:`cortex.ledger.pytree`) is its executable specification and the fallback when the
extension was not built (no C compiler at install time). Falling back is loud: a warning in
the log when this module is imported, and every service reports the active core in its
startup log, its ``/admin`` stats and its metrics (:func:`describe`).

The choice is process-wide, made once at startup (:func:`use`) before trees exist; tests
switch it to run the same suite against both cores.
"""

from __future__ import annotations

import logging
from enum import StrEnum

from cortex.ledger.model import Source
from cortex.ledger.pytree import PythonTree
from cortex.ledger.tree import RadixHashTree, TreeColumns

__all__ = ["Core", "NativeMissing", "active", "available", "describe", "new_tree", "node_bytes",
           "plan_ops", "plan_updates", "replica_target", "sync_target", "tree_from_columns",
           "tree_type", "use"]

log = logging.getLogger(__name__)


class Core(StrEnum):
    """A radix hash tree implementation."""

    NATIVE = "native"
    PYTHON = "python"


class NativeMissing(RuntimeError):
    """The compiled core was asked for but is not built (reinstall cortex-ledger with a C
    compiler and Python's headers present)."""


_TYPES: dict[Core, type[RadixHashTree]] = {Core.PYTHON: PythonTree}
_missing = ""
try:
    from cortex.ledger.native import (
        NativeTree,
        PlannedOps,
        PlannedUpdates,
        SyncTarget,
        Target,
    )
except ImportError as exc:  # the extension was not built
    _missing = str(exc)
    log.warning(
        "cortex.ledger: the compiled ledger core is NOT built (%s); radix hash trees fall "
        "back to pure Python, ~20x slower per block. Reinstall cortex-ledger with gcc and "
        "the Python headers present.", exc)
else:
    _TYPES[Core.NATIVE] = NativeTree

_active = Core.NATIVE if Core.NATIVE in _TYPES else Core.PYTHON


def available() -> list[Core]:
    """Cores this installation can run (the compiled one only when built)."""
    return list(_TYPES)


def active() -> Core:
    return _active


def use(core: Core) -> None:
    """Make ``core`` the one new trees use; :class:`NativeMissing` when it is not built."""
    global _active
    if core not in _TYPES:
        raise NativeMissing(f"the compiled ledger core is not built: {_missing}")
    _active = core


def tree_type(core: Core | None = None) -> type[RadixHashTree]:
    """The tree class of ``core`` (the active one by default)."""
    return _TYPES[_active if core is None else core]


def new_tree(initial_capacity: int = 1024) -> RadixHashTree:
    """An empty tree of the active core."""
    return _TYPES[_active](initial_capacity)


def tree_from_columns(columns: TreeColumns) -> RadixHashTree:
    """A copied tree (:meth:`RadixHashTree.from_columns`) in the active core."""
    return _TYPES[_active].from_columns(columns)


def plan_ops(raw: bytes) -> PlannedOps | None:
    """A replica batch's ops planned by the compiled core (:class:`PlannedOps`), when it is
    the active core; None otherwise, and when ``raw`` is not a protobuf message (the caller
    then takes the per-op path, which reports what is wrong)."""
    if _active is not Core.NATIVE:
        return None
    try:
        return PlannedOps(raw)
    except ValueError:
        return None


def replica_target(tree: RadixHashTree, source: Source) -> Target | None:
    """The compiled tree and bit a planned op of ``source`` applies to
    (:meth:`PlannedOps.target`); None with the pure-Python core."""
    return PlannedOps.target(tree, source) if Core.NATIVE in _TYPES else None


def plan_updates(raw: bytes) -> PlannedUpdates | None:
    """An ingest's UpdateBatch planned by the compiled core (:class:`PlannedUpdates`), when
    it is the active core; None otherwise, and when ``raw`` is not a protobuf message (the
    caller then applies update by update, which reports what is wrong)."""
    if _active is not Core.NATIVE:
        return None
    try:
        return PlannedUpdates(raw)
    except ValueError:
        return None


def _no_sync_target(tree: RadixHashTree, source: Source, domain: int, epoch: int, seq: int
                    ) -> SyncTarget | None:
    return None


sync_target = PlannedUpdates.target if Core.NATIVE in _TYPES else _no_sync_target
"""What a planned update of ``source`` applies to (:meth:`PlannedUpdates.target`); None
with the pure-Python core."""


def describe() -> dict[str, str]:
    """The active core and, when the compiled one is missing, why: for startup logs, /admin
    and metric labels."""
    out = {"core": _active.value}
    if _missing:
        out["native_missing"] = _missing
    return out


def node_bytes(words: int) -> int:
    """Estimated bytes one node costs in a tree of the active core whose holder bitsets are
    ``words`` wide (the index's memory budget counts in these)."""
    return tree_type().node_bytes(words)

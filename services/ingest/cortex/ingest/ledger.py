"""``Ledger``: one source's cached blocks, as the engine's hashes and as Cortex keys.

Engine hashes are opaque per-worker ids (spec kv-events.md §4); the ledger maps each to the
Cortex key computed from the event's tokens, so a ``BlockRemoved`` can be applied, and keeps
each key's parent for snapshots. Both maps count copies: vLLM can cache two physical blocks
with one hash and reports each store and each eviction, and two engine hashes could map to
one key; a key leaves the ledger only when its last holder does.

:meth:`Ledger.store` and :meth:`Ledger.remove` run their per-block loops in the ledger's
compiled core (``keymap_store`` / ``keymap_remove`` of ``cortex.ledger._core``: the same dict
operations in the same order, without the interpreter's work per block) when it is the
process's active core (:mod:`cortex.ledger.cores`), in Python otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cortex.kvevents.codec import BlockHash
from cortex.ledger import cores

try:
    from cortex.ledger._core import keymap_remove, keymap_store
except ImportError:  # the compiled core is not built (cores logs it): Python loops only
    _BUILT = False
else:
    _BUILT = True

__all__ = ["Ledger"]


def _compiled() -> bool:
    return _BUILT and cores.active() is cores.Core.NATIVE


class Ledger:
    """Engine hash → Cortex key, and Cortex key → parent key (insertion ordered)."""

    __slots__ = ("_dup_hash", "_dup_key", "_key_of", "_parent_of")

    def __init__(self) -> None:
        self._key_of: dict[BlockHash, int] = {}
        self._parent_of: dict[int, int] = {}
        # Extra copies beyond the first: sparse, almost always empty.
        self._dup_hash: dict[BlockHash, int] = {}
        self._dup_key: dict[int, int] = {}

    def __len__(self) -> int:
        """Distinct Cortex keys held."""
        return len(self._parent_of)

    def __repr__(self) -> str:
        return f"Ledger(keys={len(self._parent_of)}, engine_hashes={len(self._key_of)})"

    def key_of(self, engine_hash: BlockHash) -> int | None:
        return self._key_of.get(engine_hash)

    def hashes(self) -> list[BlockHash]:
        """Every engine hash held."""
        return list(self._key_of)

    def parent_of(self, key: int) -> int | None:
        """The parent key of a held key."""
        return self._parent_of.get(key)

    def copy(self) -> Ledger:
        """An independent ledger holding the same blocks."""
        other = Ledger()
        other._key_of = dict(self._key_of)
        other._parent_of = dict(self._parent_of)
        other._dup_hash = dict(self._dup_hash)
        other._dup_key = dict(self._dup_key)
        return other

    def __contains__(self, key: object) -> bool:
        return key in self._parent_of

    def keys(self) -> Iterable[int]:
        return self._parent_of.keys()

    def store(self, hashes: Sequence[BlockHash], keys: Sequence[int], parent_key: int) -> None:
        """Record a chain: ``keys[i]`` is the key of ``hashes[i]``, chained after
        ``parent_key``."""
        if _compiled():
            keymap_store(self._key_of, self._parent_of, self._dup_hash, self._dup_key, hashes,
                         keys, parent_key)
            return
        key_of, parent_of = self._key_of, self._parent_of
        parent = parent_key
        for engine_hash, key in zip(hashes, keys, strict=True):
            old = key_of.get(engine_hash)
            if old is None:
                key_of[engine_hash] = key
                if key in parent_of:
                    self._dup_key[key] = self._dup_key.get(key, 0) + 1
                else:
                    parent_of[key] = parent
            elif old == key:
                self._dup_hash[engine_hash] = self._dup_hash.get(engine_hash, 0) + 1
            else:  # the engine reused a hash for other tokens: the newest store wins
                self._forget(engine_hash)
                key_of[engine_hash] = key
                self._hold(key, parent)
            parent = key

    def _hold(self, key: int, parent: int) -> None:
        if key in self._parent_of:
            self._dup_key[key] = self._dup_key.get(key, 0) + 1
        else:
            self._parent_of[key] = parent

    def remove(self, hashes: Iterable[BlockHash]) -> tuple[list[int], int]:
        """Drop one copy of each hash; return (keys no longer held, hashes not in the
        ledger)."""
        if _compiled():
            dead_keys: list[int]
            dead_keys, missing = keymap_remove(self._key_of, self._parent_of, self._dup_hash,
                                               self._dup_key, hashes)
            return dead_keys, missing
        dead: list[int] = []
        unknown = 0
        for engine_hash in hashes:
            if engine_hash not in self._key_of:
                unknown += 1
                continue
            if self._dup_hash:
                extra = self._dup_hash.get(engine_hash)
                if extra:
                    if extra == 1:
                        del self._dup_hash[engine_hash]
                    else:
                        self._dup_hash[engine_hash] = extra - 1
                    continue
            key = self._forget(engine_hash)
            if key is not None:
                dead.append(key)
        return dead, unknown

    def _forget(self, engine_hash: BlockHash) -> int | None:
        """Remove the hash entirely; return its key if the key is no longer held."""
        if self._dup_hash:
            self._dup_hash.pop(engine_hash, None)
        key = self._key_of.pop(engine_hash)
        extra = self._dup_key.get(key) if self._dup_key else None
        if extra:
            if extra == 1:
                del self._dup_key[key]
            else:
                self._dup_key[key] = extra - 1
            return None
        del self._parent_of[key]
        return key

    def clear(self) -> None:
        self._key_of.clear()
        self._parent_of.clear()
        self._dup_hash.clear()
        self._dup_key.clear()

    def pairs(self) -> tuple[list[int], list[int]]:
        """``(parent_keys, keys)`` listed parents-first (a parent held by this ledger always
        comes before its children, even when it was re-stored after them)."""
        parent_of = self._parent_of
        parents: list[int] = []
        keys: list[int] = []
        emitted: set[int] = set()
        waiting: dict[int, list[int]] = {}
        for key, parent in parent_of.items():
            if parent in parent_of and parent not in emitted:
                waiting.setdefault(parent, []).append(key)
                continue
            stack = [key]
            while stack:
                current = stack.pop()
                parents.append(parent_of[current])
                keys.append(current)
                emitted.add(current)
                children = waiting.pop(current, None)
                if children:
                    stack.extend(reversed(children))
        for children in waiting.values():  # unreachable for a hash chain; never lose a key
            for key in children:
                if key not in emitted:
                    parents.append(parent_of[key])
                    keys.append(key)
        return parents, keys

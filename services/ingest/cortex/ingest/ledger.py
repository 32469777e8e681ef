"""``Ledger``: one source's cached blocks, as the engine's hashes and as Cortex keys.

Engine hashes are opaque per-worker ids (spec kv-events.md §4); the ledger maps each to the
Cortex key computed from the event's tokens, so a ``BlockRemoved`` can be applied, and keeps
each key's parent for snapshots. Both maps count copies: vLLM can cache two physical blocks
with one hash and reports each store and each eviction, and two engine hashes could map to
one key; a key leaves the ledger only when its last holder does.

With the ledger's compiled core built and active (:mod:`cortex.ledger.cores`) a new ledger
keeps its state in a ``cortex.ledger._core.KeyTable``: two ordered open-addressing tables of
uint64 engine hashes / keys in C, no Python object per block, applying :meth:`Ledger.store`
and :meth:`Ledger.remove` with the dicts' semantics, insertion order included (the dicts below
are the specification; ``tests/ingest/test_ledger.py`` drives both with random op streams).
A table holds ints only, in one engine's reading (vLLM's uint64 or SGLang's int64 hashes);
the first input it cannot hold exactly (a bytes hash, an int of the other reading, anything
else) moves the ledger's state into the dicts, where it stays until :meth:`Ledger.clear`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from cortex.ingest.columnar import packed_block_keys
from cortex.kvevents.codec import BlockHash
from cortex.ledger import cores

try:
    from cortex.ledger._core import KeyTable
except ImportError:  # the compiled core is not built (cores logs it): dicts only
    _BUILT = False
else:
    _BUILT = True

__all__ = ["Ledger"]

log = logging.getLogger(__name__)


def _compiled() -> bool:
    return _BUILT and cores.active() is cores.Core.NATIVE


class Ledger:
    """Engine hash → Cortex key, and Cortex key → parent key (insertion ordered)."""

    __slots__ = ("_dup_hash", "_dup_key", "_key_of", "_parent_of", "_table")

    def __init__(self, *, compiled: bool | None = None) -> None:
        """``compiled``: keep the state in a ``KeyTable`` (default: when the compiled core is
        built and active)."""
        self._table: KeyTable | None = (
            KeyTable() if (_compiled() if compiled is None else compiled and _BUILT) else None)
        self._key_of: dict[BlockHash, int] = {}
        self._parent_of: dict[int, int] = {}
        # Extra copies beyond the first: sparse, almost always empty.
        self._dup_hash: dict[BlockHash, int] = {}
        self._dup_key: dict[int, int] = {}

    @property
    def compiled(self) -> bool:
        """Whether the state is in the compiled table (else in the dicts)."""
        return self._table is not None

    def _to_dicts(self, table: KeyTable) -> None:
        """Move the state from the table into the dicts (an input the table cannot hold)."""
        self._key_of, self._parent_of, self._dup_hash, self._dup_key = table.export()
        self._table = None
        log.info("a ledger of %d keys moved from the compiled table to dicts (bytes hashes,"
                 " or ints of both readings)", len(self._parent_of))

    def __len__(self) -> int:
        """Distinct Cortex keys held."""
        table = self._table
        return len(table) if table is not None else len(self._parent_of)

    def __repr__(self) -> str:
        table = self._table
        if table is not None:
            return f"Ledger(keys={len(table)}, engine_hashes={table.hash_count}, compiled)"
        return f"Ledger(keys={len(self._parent_of)}, engine_hashes={len(self._key_of)})"

    def key_of(self, engine_hash: BlockHash) -> int | None:
        table = self._table
        return table.key_of(engine_hash) if table is not None else self._key_of.get(engine_hash)

    def hashes(self) -> list[BlockHash]:
        """Every engine hash held."""
        table = self._table
        return table.hashes() if table is not None else list(self._key_of)

    def parent_of(self, key: int) -> int | None:
        """The parent key of a held key."""
        table = self._table
        return table.parent_of(key) if table is not None else self._parent_of.get(key)

    def copy(self) -> Ledger:
        """An independent ledger holding the same blocks."""
        other = Ledger(compiled=False)
        if self._table is not None:
            other._table = self._table.copy()
            return other
        other._key_of = dict(self._key_of)
        other._parent_of = dict(self._parent_of)
        other._dup_hash = dict(self._dup_hash)
        other._dup_key = dict(self._dup_key)
        return other

    def __contains__(self, key: object) -> bool:
        table = self._table
        return key in table if table is not None else key in self._parent_of

    def keys(self) -> Iterable[int]:
        table = self._table
        return table.keys() if table is not None else self._parent_of.keys()

    def maps(self) -> tuple[dict[BlockHash, int], dict[int, int], dict[BlockHash, int],
                            dict[int, int]]:
        """Copies of the four maps (engine hash → key, key → parent, extra copies of a hash,
        of a key), the first two in insertion order: what the differential test compares."""
        if self._table is not None:
            return self._table.export()
        return (dict(self._key_of), dict(self._parent_of), dict(self._dup_hash),
                dict(self._dup_key))

    def place(self, hashes: Sequence[BlockHash], tokens: bytes, block_size: int,
              parent_key: int) -> list[int]:
        """:meth:`store` of the chain keyed from packed ``uint32`` little-endian tokens
        (:func:`~cortex.ingest.columnar.packed_block_keys`, ``len(hashes)`` blocks); its
        keys."""
        table = self._table
        if table is not None:
            placed = table.store_tokens(hashes, tokens, block_size, parent_key)
            if placed is not None and placed is not NotImplemented:
                assert type(placed) is list
                return placed
        keys = packed_block_keys(tokens, block_size, parent_key)
        self.store(hashes, keys, parent_key)
        return keys

    def store(self, hashes: Sequence[BlockHash], keys: Sequence[int], parent_key: int) -> None:
        """Record a chain: ``keys[i]`` is the key of ``hashes[i]``, chained after
        ``parent_key``."""
        table = self._table
        if table is not None:
            if table.store(hashes, keys, parent_key) is not NotImplemented:
                return
            self._to_dicts(table)
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
        table = self._table
        if table is not None:
            done = table.remove(hashes)
            if done is not NotImplemented:
                assert type(done) is tuple
                return done
            self._to_dicts(table)
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
        table = self._table
        if table is not None:
            table.clear()
            return
        if _compiled():  # empty: back to the compiled table
            self._table = KeyTable()
        self._key_of.clear()
        self._parent_of.clear()
        self._dup_hash.clear()
        self._dup_key.clear()

    def pairs(self) -> tuple[list[int], list[int]]:
        """``(parent_keys, keys)`` listed parents-first (a parent held by this ledger always
        comes before its children, even when it was re-stored after them)."""
        table = self._table
        parent_of = dict(zip(*table.items(), strict=True)) if table is not None else self._parent_of
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

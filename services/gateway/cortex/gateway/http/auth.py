"""Credentials both ways: the clients' API keys (checked here) and the workers' (sent upstream).

:class:`ApiKeys` holds only SHA-256 digests of the accepted keys, each with an id that logs
and metrics name instead of the key. A presented key is hashed once and compared with every
digest in constant time (``hmac.compare_digest``, no early exit), so neither the match nor
its position leaks through timing.

:class:`WorkerCredentials` (from :mod:`cortex.registry.credentials`, which the ingest uses
too) resolves a worker spec's ``credential`` into the ``Authorization`` header sent to it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cortex.gateway.errors import ConfigError
from cortex.registry.credentials import WorkerCredentials

__all__ = ["ApiKeys", "KeyDigest", "WorkerCredentials", "hash_key", "parse_key_lines"]

_KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


def hash_key(key: str) -> str:
    """The digest form an operator puts in the config: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyDigest:
    """One accepted API key: its id (what logs and metrics show) and ``sha256:<hex>``."""

    id: str
    hash: str

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or _KEY_ID.match(self.id) is None:
            raise ConfigError(f"auth.keys: bad key id {self.id!r} (1-64 chars of A-Z a-z 0-9 "
                              ". _ -)")
        if not isinstance(self.hash, str) or _DIGEST.match(self.hash) is None:
            raise ConfigError(f"auth.keys[{self.id}].hash: must be sha256:<64 hex digits> "
                              "(the key's digest, never the key)")

    @property
    def digest(self) -> bytes:
        return bytes.fromhex(self.hash.removeprefix("sha256:"))

    @classmethod
    def parse(cls, text: str) -> KeyDigest:
        """``<id>=sha256:<hex>`` (how ``CORTEX_GATEWAY_AUTH_KEYS`` lists keys)."""
        key_id, _, digest = text.partition("=")
        return cls(key_id.strip(), digest.strip())


def parse_key_lines(text: str, where: str) -> list[KeyDigest]:
    """A keys file: one ``<id> sha256:<hex>`` per line; blank lines and ``#`` comments skipped."""
    keys: list[KeyDigest] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{where}:{number}: expected '<id> sha256:<hex>'")
        try:
            keys.append(KeyDigest(parts[0], parts[1]))
        except ConfigError as exc:
            raise ConfigError(f"{where}:{number}: {exc}") from None
    return keys


class ApiKeys:
    """The accepted inference API keys; empty = authentication off."""

    def __init__(self, keys: Iterable[KeyDigest]) -> None:
        entries = list(keys)
        ids = [k.id for k in entries]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"auth.keys: duplicate key ids in {sorted(ids)}")
        self._entries = [(k.id, k.digest) for k in entries]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, authorization: str | None) -> str | None:
        """The id of the key an ``Authorization: Bearer <key>`` header carries, else
        ``None`` (missing, malformed or unknown)."""
        if authorization is None:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        presented = hashlib.sha256(token.encode()).digest()
        found: str | None = None
        for key_id, digest in self._entries:  # every entry, whatever matched: constant time
            if hmac.compare_digest(presented, digest):
                found = key_id
        return found

    def __repr__(self) -> str:
        return f"ApiKeys(keys={len(self._entries)})"

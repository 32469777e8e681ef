"""``WorkerSpec``: what the registry knows about one worker, validated on creation.

Stored as JSON at ``cortex:v1:worker:<id>``. Unknown JSON keys are ignored so a newer
writer does not break older readers during a rolling upgrade.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from cortex.hashing import Engine
from cortex.registry.endpoint import MAX_PORT, Endpoint, parse_endpoint
from cortex.registry.errors import SpecError

__all__ = ["SPEC_VERSION", "WorkerRole", "WorkerSpec"]

SPEC_VERSION = 1
"""Version of the JSON layout (the ``v`` field)."""

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_MAX_LABEL_VALUE = 256
_MAX_DP_SIZE = 1024
_MAX_BLOCK_SIZE = 1 << 20
_MAX_CONTEXT = 1 << 30
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MAX_LOOKAHEAD = 64  # vLLM MTP: num_speculative_tokens, never past one block


class WorkerRole(StrEnum):
    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as registered. Construction validates every field (:class:`SpecError`).

    ``kv_events`` and ``replay`` are endpoint *bases*: DP rank ``r`` uses ``port + r``.
    ``block_size`` (tokens per block) is ``None`` when unknown; ingest then learns it from
    the first ``BlockStored``. ``bootstrap_port`` applies to SGLang prefill workers only.
    ``context_length``: the engine's context (tokens) when known (discovery fills it).
    ``kv_lookahead``: tokens after a block that the engine's reuse of it needs (speculative
    decoding: vLLM EAGLE lookahead block hashes = 1, multi-module MTP = the number of
    speculative tokens; SGLang EAGLE = 1; 0 = none); ``None`` when unknown: ingest learns it
    from the events, and the gateway looks for plain keys until it is set.
    ``kv_eagle_drop``: vLLM EAGLE with its legacy block hashes (a KV connector is configured,
    e.g. PD, or ``disable_lookahead_block_hashes``): the events are plain, but the engine
    does not reuse the last block a lookup matches; the gateway credits one block less.
    """

    id: str
    url: str
    engine: Engine
    model: str
    role: WorkerRole = WorkerRole.REGULAR
    dp_size: int = 1
    kv_events: str | None = None
    topic: str = ""
    replay: str | None = None
    bootstrap_port: int | None = None
    block_size: int | None = None
    context_length: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    credential: str | None = None
    kv_lookahead: int | None = None
    kv_eagle_drop: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or _ID.match(self.id) is None:
            raise SpecError(
                f"id: {self.id!r} is not a valid worker id (1-128 chars of A-Z a-z 0-9 . _ : @ -,"
                " starting with a letter or digit)"
            )
        _check_url(self.url)
        try:
            object.__setattr__(self, "engine", Engine(self.engine))
        except ValueError:
            raise SpecError(
                f"engine: unknown engine {self.engine!r} (expected one of: "
                f"{', '.join(e.value for e in Engine)})"
            ) from None
        try:
            object.__setattr__(self, "role", WorkerRole(self.role))
        except ValueError:
            raise SpecError(
                f"role: unknown role {self.role!r} (expected one of: "
                f"{', '.join(r.value for r in WorkerRole)})"
            ) from None
        if not isinstance(self.model, str) or not self.model.strip():
            raise SpecError("model: must be a non-empty name")
        if not _is_int(self.dp_size) or not 1 <= self.dp_size <= _MAX_DP_SIZE:
            raise SpecError(
                f"dp_size: must be an integer in 1..{_MAX_DP_SIZE}, got {self.dp_size!r}"
            )
        if not isinstance(self.topic, str):
            raise SpecError("topic: must be a string")
        events = self._endpoint(self.kv_events, "kv_events")
        replay = self._endpoint(self.replay, "replay")
        if replay is not None and events is None:
            raise SpecError("replay: a replay endpoint needs a kv_events endpoint")
        if self.bootstrap_port is not None:
            if not _is_int(self.bootstrap_port) or not 1 <= self.bootstrap_port <= MAX_PORT:
                raise SpecError(
                    f"bootstrap_port: must be in 1..{MAX_PORT}, got {self.bootstrap_port!r}"
                )
            if self.engine is not Engine.SGLANG or self.role is not WorkerRole.PREFILL:
                raise SpecError("bootstrap_port: applies only to SGLang prefill workers")
        if self.block_size is not None and (
            not _is_int(self.block_size) or not 1 <= self.block_size <= _MAX_BLOCK_SIZE
        ):
            raise SpecError(
                f"block_size: must be an integer in 1..{_MAX_BLOCK_SIZE}, got {self.block_size!r}"
            )
        if self.context_length is not None and (
            not _is_int(self.context_length) or not 1 <= self.context_length <= _MAX_CONTEXT
        ):
            raise SpecError(f"context_length: must be an integer in 1..{_MAX_CONTEXT}, got "
                            f"{self.context_length!r}")
        if self.kv_lookahead is not None and (
            not _is_int(self.kv_lookahead) or not 0 <= self.kv_lookahead <= _MAX_LOOKAHEAD
        ):
            raise SpecError(f"kv_lookahead: must be an integer in 0..{_MAX_LOOKAHEAD}, got"
                            f" {self.kv_lookahead!r}")
        if not isinstance(self.kv_eagle_drop, bool):
            raise SpecError("kv_eagle_drop: must be true or false")
        if self.kv_eagle_drop and (self.engine is not Engine.VLLM or self.kv_lookahead):
            raise SpecError("kv_eagle_drop: applies to vLLM workers without kv_lookahead")
        if not isinstance(self.labels, Mapping):
            raise SpecError("labels: must be a mapping of strings")
        for key, value in self.labels.items():
            if not isinstance(key, str) or _LABEL_KEY.match(key) is None:
                raise SpecError(f"labels: bad label key {key!r}")
            if not isinstance(value, str) or len(value) > _MAX_LABEL_VALUE:
                raise SpecError(f"labels: value of {key!r} must be a string of <= 256 chars")
        object.__setattr__(self, "labels", MappingProxyType(dict(sorted(self.labels.items()))))
        _check_credential(self.credential)

    def _endpoint(self, text: str | None, what: str) -> Endpoint | None:
        if text is None:
            return None
        if not isinstance(text, str):
            raise SpecError(f"{what}: must be an endpoint string")
        endpoint = parse_endpoint(text, what=what)
        if endpoint.port is not None and endpoint.port + self.dp_size - 1 > MAX_PORT:
            raise SpecError(
                f"{what}: port {endpoint.port} + dp_size {self.dp_size} runs past {MAX_PORT}"
            )
        if endpoint.port is None and self.dp_size > 1:
            raise SpecError(f"{what}: an ipc endpoint cannot serve dp_size {self.dp_size}")
        return endpoint

    # ---- derived values ----

    @property
    def host(self) -> str:
        """Host part of ``url`` (no brackets for IPv6)."""
        return urlsplit(self.url).hostname or ""

    def kv_events_endpoint(self, rank: int = 0) -> str | None:
        """Where to connect the SUB of DP rank ``rank`` (``None``: no events published)."""
        if self.kv_events is None:
            return None
        return parse_endpoint(self.kv_events).for_rank(self._rank(rank), self.host)

    def replay_endpoint(self, rank: int = 0) -> str | None:
        """Where to connect the replay DEALER of DP rank ``rank`` (``None``: no replay)."""
        if self.replay is None:
            return None
        return parse_endpoint(self.replay).for_rank(self._rank(rank), self.host)

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"DP rank {rank} out of range for dp_size {self.dp_size}")
        return rank

    def with_changes(self, **changes: Any) -> WorkerSpec:
        """A validated copy with some fields replaced."""
        return replace(self, **changes)

    # ---- JSON ----

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": SPEC_VERSION,
            "id": self.id,
            "url": self.url,
            "engine": self.engine.value,
            "role": self.role.value,
            "model": self.model,
            "dp_size": self.dp_size,
            "kv_events": self.kv_events,
            "topic": self.topic,
            "replay": self.replay,
            "bootstrap_port": self.bootstrap_port,
            "block_size": self.block_size,
            "context_length": self.context_length,
            "labels": dict(self.labels),
            # fields that are off by default stay out: older readers see no change
            **({"credential": self.credential} if self.credential is not None else {}),
            **({"kv_lookahead": self.kv_lookahead} if self.kv_lookahead is not None else {}),
            **({"kv_eagle_drop": True} if self.kv_eagle_drop else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerSpec:
        """Build from a decoded JSON object; unknown keys are ignored."""
        if not isinstance(data, Mapping):
            raise SpecError("worker spec must be a JSON object")
        missing = [name for name in ("id", "url", "engine", "model") if name not in data]
        if missing:
            raise SpecError(f"worker spec lacks required field(s): {', '.join(missing)}")
        known = {name: data[name] for name in _FIELDS if name in data}
        if known.get("labels") is None:
            known.pop("labels", None)
        if known.get("topic") is None:
            known.pop("topic", None)
        try:
            return cls(**known)
        except TypeError as exc:
            raise SpecError(f"worker spec: {exc}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerSpec:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SpecError(f"worker spec is not valid JSON: {exc}") from None
        return cls.from_dict(data)


_FIELDS = (
    "id", "url", "engine", "model", "role", "dp_size", "kv_events", "topic", "replay",
    "bootstrap_port", "block_size", "context_length", "labels", "credential", "kv_lookahead",
    "kv_eagle_drop",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_credential(ref: object) -> None:
    """``env:NAME`` or ``file:/absolute/path``: a reference, so a key pasted in is refused."""
    if ref is None:
        return
    if not isinstance(ref, str):
        raise SpecError("credential: must be env:NAME or file:/path")
    kind, _, where = ref.partition(":")
    if kind == "env" and _ENV_NAME.match(where):
        return
    if kind == "file" and where.startswith("/") and "\0" not in where and len(where) < 4096:
        return
    raise SpecError("credential: must reference the key (env:NAME or file:/absolute/path), "
                    "not be the key")


def _check_url(url: object) -> None:
    if not isinstance(url, str) or not url:
        raise SpecError("url: must be a non-empty http(s) URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SpecError(f"url: bad URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise SpecError(f"url: {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise SpecError(f"url: {url!r} has no host")
    if "@" in parts.netloc:
        # an HTTP client would send it as Basic auth to whatever the URL names: never
        raise SpecError("url: must not carry credentials (user:password@host); workers are "
                        "reached without them")
    if port is not None and port == 0:
        raise SpecError(f"url: port 0 in {url!r}")
    if any(ch.isspace() for ch in url) or parts.query or parts.fragment:
        raise SpecError(f"url: {url!r} must be a base URL (no spaces, query or fragment)")

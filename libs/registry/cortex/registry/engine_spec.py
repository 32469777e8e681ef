"""What a worker says about itself, merged into a spec (pure).

An operator who has a worker URL should not have to retype what the engine already serves.
The answers are read by the parsers of :mod:`cortex.registry.engines` (SGLang
``/server_info``; vLLM ``/v1/models``, ``/kv_event_sources``, ``/metrics``);
:class:`Discovery` merges them and builds a :class:`WorkerSpec`, explicit values winning; a
required field that nobody supplied raises :class:`DiscoveryError` naming it. An event or
replay endpoint the engine reports as a bind address (``tcp://*:5557``, ``0.0.0.0``) is
learned at the worker URL's host, so ``cortex workers add``, ``cortex serve`` and
``cortex discover-pods`` register where a subscriber connects. The HTTP side lives in
:mod:`cortex.registry.engine_probe`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from cortex.hashing import Engine
from cortex.registry.endpoint import parse_endpoint
from cortex.registry.engines import Learned
from cortex.registry.errors import DiscoveryError, SpecError
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = ["DISCOVERABLE", "HASH_ALGO_LABEL", "REQUIRED", "Discovery", "default_worker_id"]

DISCOVERABLE = ("engine", "model", "role", "dp_size", "kv_events", "topic", "replay",
                "bootstrap_port", "block_size", "context_length")
"""Spec fields discovery tries to learn, in the order reports list them."""

REQUIRED = ("engine", "model")
"""Fields a spec cannot do without; the rest have defaults (see :class:`WorkerSpec`)."""

_ID_CHARS = re.compile(r"[^A-Za-z0-9._:@-]+")
_ENDPOINTS = ("kv_events", "replay")
HASH_ALGO_LABEL = "hash_algo"
"""The spec label that tells ingest how a vLLM worker hashes blocks (learned from the
engine's ``prefix_caching_hash_algo``)."""


def default_worker_id(url: str) -> str:
    """A registry id naming the worker by its address: ``http://10.0.0.5:30000`` →
    ``10.0.0.5-30000`` (the URL's host and port, characters ids may not hold as ``-``;
    ``http://[::1]:8000`` → ``ipv6-::1-8000``)."""
    parts = urlsplit(url)
    host = parts.hostname or "worker"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = 0
    if ":" in host:  # an id starts with a letter or digit
        host = f"ipv6-{host}"
    return _ID_CHARS.sub("-", f"{host}-{port}").strip("-.:@_")[:128] or "worker"


def _reached(endpoint: str, host: str) -> str:
    """``endpoint`` as a subscriber reaches it from another machine: a bind address
    (``tcp://*:5557``) at the worker's ``host``; anything unparsable is left for the spec's
    validation to name."""
    try:
        return str(parse_endpoint(endpoint).at_host(host)) if host else endpoint
    except SpecError:
        return endpoint


@dataclass(frozen=True, slots=True)
class Discovery:
    """What one worker said about itself.

    ``learned``: spec fields read from the engine (a ``None`` value: the engine says there
    is none); ``sources``: the endpoint each field came from (``"GET /server_info"``);
    ``problems``: what could not be read and why (``"GET /kv_event_sources: HTTP 404"``);
    ``models``: every model id the worker serves.
    """

    url: str
    learned: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "learned", MappingProxyType(dict(self.learned)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "problems", tuple(self.problems))
        object.__setattr__(self, "models", tuple(self.models))

    @classmethod
    def merge(cls, url: str, answers: Iterable[tuple[str, Learned]],
              problems: Iterable[str] = (), models: Iterable[str] = ()) -> Discovery:
        """Combine ``(source, fields)`` answers; an earlier answer's field wins. An event or
        replay endpoint reported as a bind address (``tcp://*:5557``) is learned at the host
        of ``url``, its source saying so (``"GET /kv_event_sources, bound as tcp://*:5557"``)."""
        learned: Learned = {}
        sources: dict[str, str] = {}
        for source, fields in answers:
            for name, value in fields.items():
                if name not in learned:
                    learned[name] = value
                    sources[name] = source
        host = urlsplit(url).hostname or ""
        for name in _ENDPOINTS:
            bound = learned.get(name)
            if isinstance(bound, str) and (reached := _reached(bound, host)) != bound:
                learned[name] = reached
                sources[name] += f", bound as {bound}"
        return cls(url, learned, sources, tuple(problems), tuple(models))

    @property
    def engine(self) -> Engine | None:
        engine = self.learned.get("engine")
        return engine if isinstance(engine, Engine) else None

    @property
    def tokenizer(self) -> str | None:
        """Where the engine says it loaded its tokenizer (a path *on the worker's machine*
        or a hub id): a hint for the gateway's ``models[].tokenizer``, not a spec field."""
        tokenizer = self.learned.get("tokenizer")
        return tokenizer if isinstance(tokenizer, str) else None

    def unlearned(self) -> tuple[str, ...]:
        """Discoverable fields the engine did not say anything about."""
        return tuple(name for name in DISCOVERABLE if name not in self.learned)

    def spec(self, overrides: Mapping[str, Any] | None = None, *, worker_id: str | None = None,
             require: Iterable[str] = REQUIRED) -> WorkerSpec:
        """The worker's spec: learned fields under ``overrides`` (entries set to ``None``
        are "not given"); ``worker_id`` defaults to :func:`default_worker_id`.

        Raises :class:`DiscoveryError` naming every field of ``require`` that neither the
        engine nor ``overrides`` supplied, and :class:`SpecError` for an invalid result.
        """
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        missing = [name for name in dict.fromkeys(REQUIRED + tuple(require))
                   if self.learned.get(name) is None and name not in given]
        if missing:
            raise DiscoveryError(self.url, tuple(missing), self.problems)
        values = {**{k: v for k, v in self.learned.items() if k in DISCOVERABLE}, **given}
        algo = self.learned.get(HASH_ALGO_LABEL)
        if isinstance(algo, str):  # ingest checks the engine's hashes with it
            values["labels"] = {HASH_ALGO_LABEL: algo, **(values.get("labels") or {})}
        if values.get("topic") is None:
            values.pop("topic", None)
        if values.get("role") not in (WorkerRole.PREFILL, "prefill") or \
                values.get("engine") not in (Engine.SGLANG, "sglang"):
            values.pop("bootstrap_port", None)  # only an SGLang prefill has one
        values.setdefault("id", worker_id or default_worker_id(self.url))
        values["url"] = self.url
        return WorkerSpec.from_dict(values)

    def report(self) -> list[str]:
        """Human-readable lines: what was learned from where, what was not and why."""
        lines = [f"{name} = {self.learned[name]!s} ({self.sources[name]})"
                 for name in (*DISCOVERABLE, HASH_ALGO_LABEL) if name in self.learned]
        unlearned = self.unlearned()
        if unlearned:
            lines.append(f"not learned: {', '.join(unlearned)}")
        lines += [f"problem: {problem}" for problem in self.problems]
        return lines

    def __repr__(self) -> str:
        return (f"Discovery({self.url!r}, engine={self.engine}, "
                f"learned={sorted(self.learned)}, unlearned={list(self.unlearned())})")

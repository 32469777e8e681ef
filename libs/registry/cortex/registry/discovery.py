"""What a worker says about itself, read from its engine's own HTTP endpoints (pure).

An operator who has a worker URL should not have to retype what the engine already serves:

- **SGLang** ``GET /server_info`` (old alias ``/get_server_info``): ``served_model_name`` /
  ``model_path``, ``page_size``, ``dp_size``, ``context_length``, ``disaggregation_mode``
  with ``disaggregation_bootstrap_port``, and the KV-event publisher, either as the recent
  ``kv_events`` block (``publisher``, ``endpoint_host``, ``endpoint_port_base``, ``topic``,
  ``block_size``, ``dp_size``, ``replay_endpoint_port_base``) or as the ``kv_events_config``
  JSON string it was launched with (``publisher``, ``endpoint``, ``topic``,
  ``replay_endpoint``).
- **vLLM** ``GET /v1/models`` (``id``, ``root``, ``parent``, ``max_model_len``, ``owned_by``),
  ``GET /kv_event_sources`` (a bare array, one entry per DP rank: ``data_parallel_rank``,
  ``endpoint``, ``replay_endpoint``, ``topic``) and the ``block_size`` label of the
  ``vllm:cache_config_info`` info gauge on ``GET /metrics``.

Each ``parse_*`` function turns one answer into the spec fields it carries (a field set to
``None`` means "the engine says there is none", e.g. no replay endpoint; a field left out
means "not said here"). :class:`Discovery` merges them and builds a :class:`WorkerSpec`,
explicit values winning; a required field that nobody supplied raises
:class:`DiscoveryError` naming it. The HTTP side lives in :mod:`cortex.registry.discoverer`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from cortex.hashing import Engine
from cortex.registry.errors import DiscoveryError
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = [
    "DISCOVERABLE",
    "REQUIRED",
    "Discovery",
    "default_worker_id",
    "looks_like_sglang",
    "parse_sglang_server_info",
    "parse_v1_models",
    "parse_vllm_kv_event_sources",
    "parse_vllm_metrics",
]

DISCOVERABLE = ("engine", "model", "role", "dp_size", "kv_events", "topic", "replay",
                "bootstrap_port", "block_size", "context_length")
"""Spec fields discovery tries to learn, in the order reports list them."""

REQUIRED = ("engine", "model")
"""Fields a spec cannot do without; the rest have defaults (see :class:`WorkerSpec`)."""

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # what an SGLang prefill listens on when not told
_SGLANG_DEFAULT_ENDPOINT = "tcp://*:5557"  # the zmq publisher's default bind
_OFF = (None, "", "null", "none")  # SGLang's "no publisher" spellings
_CACHE_CONFIG = re.compile(r'^vllm:cache_config_info\{(?P<labels>[^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(?P<key>[A-Za-z_][A-Za-z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
_ID_CHARS = re.compile(r"[^A-Za-z0-9._:@-]+")

Learned = dict[str, Any]


def _int(value: object, low: int = 1) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return None
    return value


def _name(value: object) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _tcp(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def looks_like_sglang(info: object) -> bool:
    """Whether a ``/server_info`` body is SGLang's (vLLM's dev-mode ``/server_info`` is a
    different object that shares the path)."""
    return isinstance(info, Mapping) and ("page_size" in info or "model_path" in info)


def parse_sglang_server_info(info: Mapping[str, Any]) -> Learned:
    """The spec fields of an SGLang ``/server_info`` body."""
    learned: Learned = {"engine": Engine.SGLANG}
    model = _name(info.get("served_model_name")) or _name(info.get("model_path"))
    if model is not None:
        learned["model"] = model
    if (tokenizer := _name(info.get("tokenizer_path")) or _name(info.get("model_path"))):
        learned["tokenizer"] = tokenizer
    mode = info.get("disaggregation_mode")
    role = WorkerRole.REGULAR if mode in _OFF else {
        "prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}.get(str(mode))
    if role is not None:
        learned["role"] = role
        port = _int(info.get("disaggregation_bootstrap_port"))
        learned["bootstrap_port"] = (
            (port or SGLANG_DEFAULT_BOOTSTRAP_PORT) if role is WorkerRole.PREFILL else None)
    if (context := _int(info.get("context_length"))) is not None:
        learned["context_length"] = context
    block = info.get("kv_events")
    block = block if isinstance(block, Mapping) else {}
    # the kv_events block is what the engine computed; page_size is the launch argument
    for name, value in (("dp_size", block.get("dp_size", info.get("dp_size"))),
                        ("block_size", block.get("block_size", info.get("page_size")))):
        if (number := _int(value)) is not None:
            learned[name] = number
    learned.update(_sglang_events(block, info.get("kv_events_config")))
    return learned


def _sglang_events(block: Mapping[str, Any], launch_config: object) -> Learned:
    """Endpoints from the ``kv_events`` block, else from the launch ``kv_events_config``."""
    config: Mapping[str, Any] | None = None
    if isinstance(launch_config, Mapping):
        config = launch_config
    elif isinstance(launch_config, str) and launch_config.strip():
        try:
            decoded = json.loads(launch_config)
        except ValueError:
            decoded = None
        config = decoded if isinstance(decoded, Mapping) else None
    if block:
        if block.get("publisher") in _OFF:
            return {"kv_events": None, "replay": None, "topic": ""}
        host, port = block.get("endpoint_host"), _int(block.get("endpoint_port_base"))
        if not isinstance(host, str) or not host or port is None:
            return {}
        replay_port = _int(block.get("replay_endpoint_port_base"))
        learned: Learned = {"kv_events": _tcp(host, port)}
        if replay_port is not None:
            learned["replay"] = _tcp(host, replay_port)
        elif config is not None:  # the block of some releases omits it; the launch has it
            learned["replay"] = _name(config.get("replay_endpoint"))
        else:
            learned["replay"] = None
        if isinstance(block.get("topic"), str):
            learned["topic"] = block["topic"]
        return learned
    if launch_config in _OFF:
        return {"kv_events": None, "replay": None, "topic": ""}
    if config is None:
        return {}
    if config.get("publisher", "null") in _OFF:
        return {"kv_events": None, "replay": None, "topic": ""}
    learned = {"kv_events": _name(config.get("endpoint")) or _SGLANG_DEFAULT_ENDPOINT,
               "replay": _name(config.get("replay_endpoint"))}
    if isinstance(config.get("topic", ""), str):
        learned["topic"] = config.get("topic", "")
    return learned


def parse_v1_models(body: Mapping[str, Any]) -> tuple[Learned, tuple[str, ...]]:
    """``(fields, every served model id)`` of an OpenAI ``/v1/models`` body.

    The model is the first base model (``parent`` null: LoRA adapters name their parent);
    ``max_model_len`` (vLLM, SGLang) is its context length; ``owned_by`` names the engine.
    """
    data = body.get("data")
    cards = [c for c in data if isinstance(c, Mapping) and _name(c.get("id"))] \
        if isinstance(data, list) else []
    ids = tuple(str(c["id"]).strip() for c in cards)
    base = next((c for c in cards if c.get("parent") is None), cards[0] if cards else None)
    learned: Learned = {}
    if base is None:
        return learned, ids
    learned["model"] = str(base["id"]).strip()
    if (root := _name(base.get("root"))) is not None:
        learned["tokenizer"] = root  # where the engine loaded the model (and its tokenizer)
    if (context := _int(base.get("max_model_len"))) is not None:
        learned["context_length"] = context
    owner = base.get("owned_by")
    if owner in ("vllm", "sglang"):
        learned["engine"] = Engine(owner)
    return learned, ids


def parse_vllm_kv_event_sources(body: object) -> tuple[Learned, str | None]:
    """``(fields, problem)`` of vLLM's ``/kv_event_sources`` (one entry per DP rank).

    The spec holds endpoint *bases* (rank r on port + r): ranks whose ports do not follow
    that rule cannot be described, and are reported as a problem instead.
    """
    if not isinstance(body, list):
        return {}, "not a JSON array"
    if not body:  # the engine publishes no KV events
        return {"kv_events": None, "replay": None, "topic": ""}, None
    ranks: dict[int, Mapping[str, Any]] = {}
    for entry in body:
        rank = _int(entry.get("data_parallel_rank", 0), low=0) \
            if isinstance(entry, Mapping) else None
        if rank is None or rank in ranks:
            return {}, "an entry lacks a distinct data_parallel_rank"
        ranks[rank] = entry
    if sorted(ranks) != list(range(len(ranks))):
        return {}, f"DP ranks {sorted(ranks)} are not 0..{len(ranks) - 1}"
    learned: Learned = {"dp_size": len(ranks)}
    for name, key in (("kv_events", "endpoint"), ("replay", "replay_endpoint")):
        values = [ranks[r].get(key) for r in range(len(ranks))]
        if all(v is None for v in values):
            learned[name] = None
            continue
        base = _consecutive([v if isinstance(v, str) else "" for v in values])
        if base is None:
            return {}, f"the {key}s {values} are not one base port + DP rank"
        learned[name] = base
    if learned.get("kv_events") is None and learned.get("replay") is not None:
        return {}, "a replay endpoint without an event endpoint"
    topic = ranks[0].get("topic", "")
    learned["topic"] = topic if isinstance(topic, str) else ""
    return learned, None


def _consecutive(endpoints: list[str]) -> str | None:
    """The base endpoint when rank r is ``host:(port0 + r)`` for every r, else ``None``."""
    parts = [endpoint.rpartition(":") for endpoint in endpoints]
    if not all(sep and port.isdigit() and host.startswith("tcp://") for host, sep, port in parts):
        return None
    hosts = {host for host, _, _ in parts}
    ports = [int(port) for _, _, port in parts]
    if len(hosts) != 1 or ports != list(range(ports[0], ports[0] + len(ports))):
        return None
    return endpoints[0]


def parse_vllm_metrics(text: str) -> Learned:
    """``block_size`` from the ``vllm:cache_config_info`` labels of a ``/metrics`` text."""
    for match in _CACHE_CONFIG.finditer(text):
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"])}
        size = labels.get("block_size", "")
        if size.isdigit() and int(size) >= 1:
            return {"block_size": int(size)}
    return {}


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
        """Combine ``(source, fields)`` answers; an earlier answer's field wins."""
        learned: Learned = {}
        sources: dict[str, str] = {}
        for source, fields in answers:
            for name, value in fields.items():
                if name not in learned:
                    learned[name] = value
                    sources[name] = source
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
                 for name in DISCOVERABLE if name in self.learned]
        unlearned = self.unlearned()
        if unlearned:
            lines.append(f"not learned: {', '.join(unlearned)}")
        lines += [f"problem: {problem}" for problem in self.problems]
        return lines

    def __repr__(self) -> str:
        return (f"Discovery({self.url!r}, engine={self.engine}, "
                f"learned={sorted(self.learned)}, unlearned={list(self.unlearned())})")

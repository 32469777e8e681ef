"""Config sections of the serving path: the listener, the models, routing, where the index,
registry and workers are and how they are watched, upstream calls, admission, PD, tokenizing.

Part of :class:`~cortex.gateway.config.gateway.GatewayConfig` (import them from there); each section
validates itself on creation and names the offending key in its :class:`ConfigError`. The
operator's surface (auth, CORS, access log, tracing) is in :mod:`cortex.gateway.config.middleware`.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from cortex.chat.vision import VisionConfig, load_vision_config
from cortex.gateway.errors import ConfigError
from cortex.hashing import Engine, HashDomain
from cortex.registry.addresses import DEFAULT_DENIED, AddressPolicy
from cortex.registry.errors import SpecError
from cortex.registry.spec import WorkerSpec

__all__ = [
    "SESSION_HEADERS",
    "AdmissionConfig",
    "BreakerConfig",
    "DiscoveryConfig",
    "HealthConfig",
    "IndexConfig",
    "LoadConfig",
    "ModelConfig",
    "PDConfig",
    "RegistryConfig",
    "RoutingConfig",
    "RoutingWeights",
    "ServerConfig",
    "SessionConfig",
    "Timeouts",
    "TokenizeConfig",
    "UpstreamConfig",
    "non_negative",
    "positive",
]


def positive(section: str, **values: float) -> None:
    """``ConfigError`` naming the first of ``values`` that is not > 0."""
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{section}.{name}: must be > 0, got {value!r}")


def non_negative(section: str, **values: float) -> None:
    """``ConfigError`` naming the first of ``values`` that is < 0."""
    for name, value in values.items():
        if value < 0:
            raise ConfigError(f"{section}.{name}: must be >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP listener. ``admin_token`` unset disables the admin API.

    Slow or silent clients: ``keep_alive_timeout_s`` bounds an idle connection and the
    arrival of a request's headers; ``body_timeout_s`` the arrival of its whole body (408
    after); ``read_timeout_s`` closes a connection nothing was read from for
    that long — a client reading a stream sends nothing, so it must exceed the longest
    response (``upstream.request_timeout_s``). ``max_connections``: open client connections
    per process (0 = no cap); one more is answered 503 and closed at once.

    Connections that never become requests (:mod:`cortex.gateway.http.h1`): one the
    peer closed frees its place at once; ``header_timeout_s`` bounds the wait for the first
    request's headers on a new connection (closed after, no answer);
    ``max_connections_per_peer`` caps the connections of one client address (0 = no cap;
    behind a proxy every client shares its address, so raise it there);
    ``write_timeout_s``: a client that reads nothing of its answer for this long loses its
    connection (its upstream request is cancelled); ``max_header_bytes``: request headers
    larger in total are answered 431.

    Shutdown (SIGTERM): readiness turns 503 at once, requests are still served for
    ``drain_delay_s`` (load balancers and Kubernetes endpoints notice the probe), then the
    listener closes and in-flight requests get ``graceful_timeout_s`` to finish.
    """

    host: str = "0.0.0.0"
    """Listen address."""
    port: int = 8080
    """Listen port; /metrics and /health/* too."""
    max_body_bytes: int = 16 * 1024 * 1024
    admin_token: str | None = field(default=None, repr=False)
    graceful_timeout_s: float = 10.0
    drain_delay_s: float = 0.0
    keep_alive_timeout_s: float = 75.0
    backlog: int = 1024
    body_timeout_s: float = 30.0
    read_timeout_s: float = 900.0
    max_connections: int = 4096
    max_connections_per_peer: int = 1024
    header_timeout_s: float = 10.0
    write_timeout_s: float = 60.0
    max_header_bytes: int = 32 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port: must be in 0..65535, got {self.port}")
        positive("server", max_body_bytes=self.max_body_bytes, backlog=self.backlog,
                 keep_alive_timeout_s=self.keep_alive_timeout_s,
                 body_timeout_s=self.body_timeout_s, read_timeout_s=self.read_timeout_s,
                 header_timeout_s=self.header_timeout_s, write_timeout_s=self.write_timeout_s,
                 max_header_bytes=self.max_header_bytes)
        non_negative("server", max_connections=self.max_connections,
                     max_connections_per_peer=self.max_connections_per_peer)
        non_negative("server", graceful_timeout_s=self.graceful_timeout_s,
                     drain_delay_s=self.drain_delay_s)
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("server.admin_token: must be at least 16 characters")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One served model: how to produce exactly the tokens its engines see.

    ``tokenizer``: a ``tokenizer.json`` (or its directory); ``None`` = the default DeepSeek
    tokenizer. ``chat_template``: a Jinja file (or ``tokenizer_config.json``); ``None`` = the
    tokenizer directory's template, else the default. ``block_size`` (tokens) and ``engine``
    with ``hash_model`` (defaults to ``name``) form the hash domain. ``reports_cached_tokens``:
    the engines run with cache reporting on, so a usage without ``cached_tokens`` means 0
    (truth check). ``tokenize_cache_tokens`` / ``tokenize_cache_bytes`` bound the model's
    segment cache. ``max_model_len``: the engines' context length, what ``POST /tokenize``
    reports (``None``: the tokenizer's ``model_max_length``, else -1) and, when set, the
    context the request bounds use instead of the one learned from the engines.

    Bounds (:mod:`cortex.gateway.request.payload`; ``None`` = learned from the engines' context
    length): ``max_prompt_tokens`` rejects longer prompts, ``max_tokens`` larger requested
    completions (400). ``max_messages`` caps a chat request's messages.
    ``precheck_chars_per_token``: a text prompt longer than ``max_prompt_tokens`` times this
    many characters is rejected before tokenizing (measured with the DeepSeek tokenizer:
    prose, code, JSON, CJK and base64 average 1.4-5.2 characters per token; only long runs
    of one repeated character go beyond 16, up to 128).

    ``first_byte_timeout_s`` / ``response_timeout_s`` / ``stream_idle_timeout_s``: this
    model's upstream timeouts (``None`` = the ``upstream`` section's; :class:`Timeouts`).

    ``adapters``: LoRA adapters every worker of this model serves, addressable as ``model``
    (besides those the workers list in ``/v1/models`` with this model as ``parent``).
    ``passthrough``: the gateway only proxies this model — no tokenizing, no KV or PD
    decisions; each request goes to the least loaded routable worker of the model, or to
    ``upstream_url`` when set (an upstream scheduler that places requests itself).

    Media (:mod:`cortex.chat.media`): ``model_dir`` holds the model's ``config.json`` and
    ``preprocessor_config.json`` (default: the tokenizer's directory); for a supported
    vision-language family the images of a request are keyed exactly. ``immutable_urls``:
    an ``http(s)`` image URL always names the same bytes (its identifier is the URL's hash).
    ``image_headers`` (with ``immutable_urls``): the gateway reads the first
    ``image_header_bytes`` of such a URL (a ranged GET, within ``image_timeout_s`` seconds)
    for the image's size, so its run is keyed exactly too; a URL that answers an error is
    refused (400), one declaring more than ``max_image_bytes`` too (413); a read that times
    out leaves the image unkeyed.
    """

    name: str
    engine: Engine = Engine.SGLANG
    block_size: int = 16
    tokenizer: Path | None = None
    chat_template: Path | None = None
    hash_model: str | None = None
    max_prompt_tokens: int | None = None
    tokenize_cache_tokens: int = 1_000_000
    reports_cached_tokens: bool = True
    tokenize_cache_bytes: int = 256 * 1024 * 1024
    max_model_len: int | None = None
    max_tokens: int | None = None
    max_messages: int = 4096
    precheck_chars_per_token: float = 16.0
    first_byte_timeout_s: float | None = None
    response_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None
    adapters: tuple[str, ...] = ()
    passthrough: bool = False
    upstream_url: str | None = None
    model_dir: Path | None = None
    immutable_urls: bool = False
    image_headers: bool = False
    image_header_bytes: int = 64 * 1024
    image_timeout_s: float = 2.0
    max_image_bytes: int = 20 * 1024 * 1024
    _domain: HashDomain = field(init=False, repr=False, compare=False)
    _vision: VisionConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("models[].name: must be a non-empty string")
        where = f"models[{self.name}]"
        try:
            object.__setattr__(self, "engine", Engine(self.engine))
        except ValueError:
            raise ConfigError(f"{where}.engine: must be one of sglang, vllm") from None
        positive(where, block_size=self.block_size)
        non_negative(where, tokenize_cache_tokens=self.tokenize_cache_tokens,
                     tokenize_cache_bytes=self.tokenize_cache_bytes)
        if self.max_model_len is not None:
            positive(where, max_model_len=self.max_model_len)
        if self.max_prompt_tokens is not None:
            positive(where, max_prompt_tokens=self.max_prompt_tokens)
        if self.max_tokens is not None:
            positive(where, max_tokens=self.max_tokens)
        positive(where, max_messages=self.max_messages,
                 precheck_chars_per_token=self.precheck_chars_per_token)
        positive(where, image_header_bytes=self.image_header_bytes,
                 image_timeout_s=self.image_timeout_s, max_image_bytes=self.max_image_bytes)
        if self.image_headers and not self.immutable_urls:
            raise ConfigError(f"{where}.image_headers: needs immutable_urls (an image is "
                              "identified by its URL only where URLs are immutable)")
        for name in ("first_byte_timeout_s", "response_timeout_s", "stream_idle_timeout_s"):
            if getattr(self, name) is not None:
                positive(where, **{name: getattr(self, name)})
        for name in ("tokenizer", "chat_template", "model_dir"):
            value = getattr(self, name)
            if value is not None:
                path = Path(value)
                if not path.exists():
                    raise ConfigError(f"{where}.{name}: {path} does not exist")
                object.__setattr__(self, name, path)
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if not all(isinstance(a, str) and a for a in self.adapters):
            raise ConfigError(f"{where}.adapters: must be non-empty strings")
        if self.upstream_url is not None:
            if not self.passthrough:
                raise ConfigError(f"{where}.upstream_url: only for a passthrough model")
            parts = urlsplit(self.upstream_url)
            if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
                raise ConfigError(f"{where}.upstream_url: {self.upstream_url!r} must be an "
                                  "http(s) base URL without credentials")
        try:  # once: routing asks for it per request (its seed is a hash)
            domain = HashDomain(self.hash_model or self.name, self.block_size, self.engine)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        object.__setattr__(self, "_domain", domain)
        base = self.model_dir or (self.tokenizer if self.tokenizer is not None
                                  and Path(self.tokenizer).is_dir() else None)
        try:
            vision = load_vision_config(base) if base is not None else None
        except ValueError as exc:
            raise ConfigError(f"{where}.model_dir: {exc}") from None
        object.__setattr__(self, "_vision", vision)

    @property
    def vision(self) -> VisionConfig | None:
        """The image settings of a supported vision-language family (``None``: none)."""
        return self._vision

    @property
    def domain(self) -> HashDomain:
        """The hash domain (model + block size + engine kind) this model's keys live in."""
        return self._domain


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """``score(w) = alpha*credited_tokens - beta*active_requests - gamma*queued_requests
    - delta*prefilling_tokens``.

    ``alpha`` per cached prompt token, ``beta`` per request running on the worker (the
    larger of the gateway's own in-flight count and the engine's running count), ``gamma``
    per request waiting in the engine's queue (the engine-reported proxy of queue delay),
    ``delta`` per uncached prompt token this gateway has sent the worker and not yet seen
    the first byte of (the prefill queued ahead of the request). With ``delta == alpha`` a
    token of someone else's prefill ahead of the request weighs as much as one of its own:
    the score ranks workers by the prefill work standing between the request and its first
    token. 0 by default; 0.5 is the setting measured for real prompt sizes (a cached token
    saves the request's time and the cluster's prefill work, a queued one costs only the
    request's time), not the default while a lazily walked burst can split (docs/gateway.md
    step 5).
    ``delta_hit_share``: a worker credited with at least this share of the prompt is
    exempt from the ``delta`` term (a conversation's next turn stays with the worker
    holding its history, as with sglang-router's ``cache_threshold``); 1.0 exempts none.

    ``host_hit`` / ``disk_hit``: what a cached token in the worker's host / disk tier is
    worth, as a fraction of a device hit (the prefill time it saves: ``1 - load / recompute``
    per token, docs/gateway.md "Memory tiers"); 0 credits device hits only.

    ``session``: a live agent session between turns, in running requests: a worker's load
    is at least ``session`` times the other sessions whose last turn it served (0: paced
    agents read idle between turns). ``session_home``: the same weight when the request
    starts a session (names one the gateway does not know): where its first turn goes, its
    next turns follow, so the sessions already living on a worker weigh for as long as it
    does. ``kv_pressure``: the extra cost, per uncached prompt
    token, of a worker whose KV pool is full (scaled by how far past
    ``routing.kv_full_fraction`` it is): storing a new prefix there evicts another.
    """

    alpha: float = 1.0
    beta: float = 64.0
    gamma: float = 128.0
    delta: float = 0.5
    delta_hit_share: float = 0.5
    host_hit: float = 0.75
    disk_hit: float = 0.25
    session: float = 1.0
    session_home: float = 8.0
    kv_pressure: float = 1.0

    def __post_init__(self) -> None:
        non_negative("routing", alpha=self.alpha, beta=self.beta, gamma=self.gamma,
                     delta=self.delta, session=self.session, session_home=self.session_home,
                     kv_pressure=self.kv_pressure)
        for name, value in (("host_hit", self.host_hit), ("disk_hit", self.disk_hit),
                            ("delta_hit_share", self.delta_hit_share)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"routing.weights.{name}: must be within [0, 1], got {value}")


SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "thread-id", "x-session-id")
"""The agent session headers honoured by default (Claude Code, Codex, generic)."""


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Session hints: a client's session id as an affinity signal (docs/gateway.md
    "Session hints").

    ``headers``: request headers naming a session, the first present wins (lower case; an
    empty list ignores headers); ``prompt_cache_key``: honour OpenAI's ``prompt_cache_key``
    body field (chat, completions, responses) when no header names one. ``ttl_s``: a
    session's worker is remembered this long after its last turn; ``max_sessions`` bounds
    the table (least recently seen first out). ``live_s``: a session counts as load on its
    worker this long after its last turn was routed (the think time between turns).
    """

    enabled: bool = True
    headers: tuple[str, ...] = SESSION_HEADERS
    prompt_cache_key: bool = True
    ttl_s: float = 1800.0
    live_s: float = 60.0
    max_sessions: int = 100_000

    def __post_init__(self) -> None:
        positive("routing.sessions", ttl_s=self.ttl_s, max_sessions=self.max_sessions)
        non_negative("routing.sessions", live_s=self.live_s)
        object.__setattr__(self, "headers", tuple(h.strip().lower() for h in self.headers
                                                  if h.strip()))


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Scoring and the predicted blocks.

    ``high_watermark``: active requests at or above which a worker gets no cache credit
    (``watermarks`` overrides it per worker id; a worker label ``cortex/high-watermark``
    too). ``predicted_ttl_s``: how long a routed request's blocks are credited to the chosen
    worker.
    ``load_stale_after_s``: engine load older than this counts as missing.
    ``kv_full_fraction``: the share of a worker's KV capacity (blocks) past which its pool
    counts as filling up (the ``kv_pressure`` weight grows from 0 there to 1 at full).
    """

    weights: RoutingWeights = field(default_factory=RoutingWeights)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    kv_full_fraction: float = 0.9
    high_watermark: int = 64
    watermarks: Mapping[str, int] = field(default_factory=dict)
    predicted_ttl_s: float = 2.0
    predicted_max_keys: int = 1_000_000
    load_stale_after_s: float = 2.0

    def __post_init__(self) -> None:
        positive("routing", high_watermark=self.high_watermark,
                 predicted_max_keys=self.predicted_max_keys,
                 load_stale_after_s=self.load_stale_after_s)
        non_negative("routing", predicted_ttl_s=self.predicted_ttl_s)
        if not 0.0 < self.kv_full_fraction <= 1.0:
            raise ConfigError("routing.kv_full_fraction: must be within (0, 1], got "
                              f"{self.kv_full_fraction}")
        for worker, mark in self.watermarks.items():
            if not isinstance(mark, int) or mark < 1:
                raise ConfigError(f"routing.watermarks.{worker}: must be an integer >= 1")
        object.__setattr__(self, "watermarks", types.MappingProxyType(dict(self.watermarks)))


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Index replicas (``host:port``, failover in order; empty = no index), the gateway's
    live ledger replica, and the gRPC Match used while the replica is not usable.

    ``replica``: keep a replica (``Index.Replicate``) and match in process. ``replica_grace_s``:
    the replica answers while its last applied batch (heartbeats included: the index sends
    one every 0.5 s when idle) is at most this old; a stream silent this long is dropped.
    ``replica_touch_interval_s``: how often matched blocks are reported to the index.
    ``match_timeout_ms`` bounds one gRPC Match; ``retry_after_ms``: a failed index is skipped
    this long; ``workers_poll_s``: ledger states polled while the replica is not usable.
    ``token_file``: a file with the index's peer token (its ``--peer-token-file``), presented
    on every call. ``frames``: the replica streams over Cortex frames (the index's port
    without HTTP/2); an index that does not answer them is replicated over gRPC.
    """

    targets: tuple[str, ...] = ()
    token_file: str = ""
    replica: bool = True
    frames: bool = True
    replica_grace_s: float = 2.0
    replica_touch_interval_s: float = 1.0
    match_timeout_ms: float = 100.0
    retry_after_ms: float = 1000.0
    workers_poll_s: float = 2.0

    def __post_init__(self) -> None:
        positive("index", match_timeout_ms=self.match_timeout_ms,
                 retry_after_ms=self.retry_after_ms, workers_poll_s=self.workers_poll_s,
                 replica_grace_s=self.replica_grace_s,
                 replica_touch_interval_s=self.replica_touch_interval_s)
        for target in self.targets:
            host, _, port = target.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"index.targets: {target!r} is not host:port")


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Worker registry. ``redis_url`` unset = an in-process registry (single gateway).

    ``forget_after_s``: a worker that left the pool without a tombstone is still probed
    this long (s), and brought back with its last spec when it answers; 0 = never."""

    redis_url: str | None = None
    lease_ttl_s: float = 10.0
    poll_interval_s: float = 1.0
    forget_after_s: float = 3600.0

    def __post_init__(self) -> None:
        positive("registry", lease_ttl_s=self.lease_ttl_s, poll_interval_s=self.poll_interval_s)
        non_negative("registry", forget_after_s=self.forget_after_s)


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Workers known by URL alone (a static seed): at start each worker's engine is asked
    for its spec (:func:`cortex.registry.discover`) and the spec is seeded into the
    registry like ``workers`` (the start waits for them at most ``timeout_s``); a worker that
    does not answer, or does not say its engine, model and block size, is asked again every
    ``retry_interval_s``. ``timeout_s`` bounds each request of a discovery (also of
    ``POST /admin/workers`` with a bare URL).

    Worker addresses (:mod:`cortex.registry.addresses`, for seeds, the admin API and every
    spec read from the registry): ``denied_worker_addresses`` (CIDR networks and host
    names; default: link-local and the cloud metadata services) are refused;
    ``allowed_worker_addresses`` non-empty: only those are accepted."""

    worker_urls: tuple[str, ...] = ()
    timeout_s: float = 5.0
    retry_interval_s: float = 10.0
    denied_worker_addresses: tuple[str, ...] = DEFAULT_DENIED
    allowed_worker_addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        positive("discovery", timeout_s=self.timeout_s,
                 retry_interval_s=self.retry_interval_s)
        try:
            policy = self.address_policy
        except ValueError as exc:
            raise ConfigError(f"discovery.denied/allowed_worker_addresses: {exc}") from None
        for url in self.worker_urls:
            try:
                WorkerSpec(id="seed", url=url, engine=Engine.SGLANG, model="seed")
            except SpecError as exc:
                raise ConfigError(f"discovery.worker_urls: {exc}") from None
            try:
                policy.check_host(urlsplit(url).hostname or "")
            except SpecError as exc:
                raise ConfigError(f"discovery.worker_urls: {url}: {exc}") from None

    @property
    def address_policy(self) -> AddressPolicy:
        """The rule for worker addresses (``ValueError`` for a malformed entry)."""
        return AddressPolicy.of(self.denied_worker_addresses, self.allowed_worker_addresses)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Worker health probes; each success re-asserts the worker's registry lease.

    ``remove_after_s``: failed probes keep renewing the lease this long (s) after the first
    failure of a streak (probe timeouts while this gateway has requests open on the worker
    never count); then the lease is left to lapse, which removes the worker everywhere."""

    interval_s: float = 2.0
    timeout_s: float = 2.0
    unhealthy_after: int = 2
    healthy_after: int = 1
    remove_after_s: float = 30.0

    def __post_init__(self) -> None:
        positive("health", interval_s=self.interval_s, timeout_s=self.timeout_s,
                 unhealthy_after=self.unhealthy_after, healthy_after=self.healthy_after)
        non_negative("health", remove_after_s=self.remove_after_s)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-worker circuit breaker: ``failures`` within ``window_s`` open it for ``open_s``,
    then ``half_open_successes`` consecutive successes close it."""

    failures: int = 5
    window_s: float = 30.0
    open_s: float = 10.0
    half_open_successes: int = 2

    def __post_init__(self) -> None:
        positive("breaker", failures=self.failures, window_s=self.window_s, open_s=self.open_s,
                 half_open_successes=self.half_open_successes)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Engine load polling (SGLang ``/v1/loads`` | ``/get_load``, vLLM ``/metrics``);
    ``poll_interval_s`` 0: off (the engines' queues, KV capacity and work marks are then
    unknown: routing counts this gateway's own requests, the wedge watch probes)."""

    poll_interval_s: float = 0.5
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        non_negative("load", poll_interval_s=self.poll_interval_s)
        positive("load", timeout_s=self.timeout_s)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """One model's upstream timeouts (seconds); see :class:`UpstreamConfig`."""

    first_byte_s: float
    response_s: float
    stream_idle_s: float

    @classmethod
    def of(cls, model: ModelConfig, upstream: UpstreamConfig) -> Timeouts:
        """``model``'s own values where set, else ``upstream``'s."""
        return cls(
            model.first_byte_timeout_s or upstream.first_byte_timeout_s,
            model.response_timeout_s or upstream.response_timeout_s,
            model.stream_idle_timeout_s or upstream.stream_idle_timeout_s)


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Calls to workers. ``request_timeout_s`` bounds a whole request (routing included);
    ``max_attempts`` counts the first try; only failures before the first byte retry.

    An attempt that has not produced its first byte in time is a failure (counted by the
    worker's breaker) and moves to the next worker: ``first_byte_timeout_s`` for a stream
    (until its first event), ``response_timeout_s`` for a non-streamed request, whose first
    byte is the whole answer. ``stream_idle_timeout_s``: a stream silent this long after its
    first event ends with an SSE error event and its upstream request is cancelled. Models
    may override the three (:class:`ModelConfig`).

    Wedged workers (:mod:`cortex.gateway.fleet.pool`): an attempt that waited
    ``wedge_after_s`` for its first byte on a worker that sent nothing for as long gets the
    worker probed (a one-token streamed completion, ``wedge_probe_timeout_s`` for its first
    event); unanswered, every attempt waiting on the worker fails over at once
    (``wedge_after_s`` 0: off).

    ``max_answer_bytes``: the largest non-streamed answer (or error body) read from a
    worker; one announcing or reaching more is not read further and the client gets 502
    ``upstream_too_large`` (not retried: another worker would answer the same). Streams are
    relayed event by event and bounded by ``max_tokens`` and the idle timeout.

    ``http_client``: ``lean`` (default) calls plain-HTTP workers through the gateway's own
    HTTP/1.1 connection pool (:mod:`cortex.gateway.upstream.h1`), ``aiohttp`` through
    aiohttp's client; ``https`` workers always go through aiohttp."""

    connect_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    max_attempts: int = 3
    max_connections: int = 0
    retry_statuses: tuple[int, ...] = (429, 500, 502, 503, 504)
    first_byte_timeout_s: float = 60.0
    response_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 30.0
    wedge_after_s: float = 4.0
    wedge_probe_timeout_s: float = 8.0
    max_answer_bytes: int = 32 * 1024 * 1024
    http_client: str = "lean"

    def __post_init__(self) -> None:
        if self.http_client not in ("lean", "aiohttp"):
            raise ConfigError(f"upstream.http_client: must be lean or aiohttp, got "
                              f"{self.http_client!r}")
        non_negative("upstream", wedge_after_s=self.wedge_after_s)
        positive("upstream", wedge_probe_timeout_s=self.wedge_probe_timeout_s,
                 max_answer_bytes=self.max_answer_bytes)
        positive("upstream", connect_timeout_s=self.connect_timeout_s,
                 request_timeout_s=self.request_timeout_s, max_attempts=self.max_attempts,
                 first_byte_timeout_s=self.first_byte_timeout_s,
                 response_timeout_s=self.response_timeout_s,
                 stream_idle_timeout_s=self.stream_idle_timeout_s)
        non_negative("upstream", max_connections=self.max_connections)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Load shedding (:class:`cortex.gateway.http.messages.Admission`): at most
    ``max_concurrent_requests`` inference requests in service per process (0 = no limit),
    ``queue_size`` more waiting up to ``queue_timeout_s``; refusals carry ``Retry-After:
    retry_after_s``."""

    max_concurrent_requests: int = 1024
    """Inference requests in service at once, 0 = no limit."""
    queue_size: int = 1024
    """Requests waiting for a slot."""
    queue_timeout_s: float = 30.0
    """Longest wait for a slot (s)."""
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        non_negative("admission", max_concurrent_requests=self.max_concurrent_requests,
                     queue_size=self.queue_size)
        positive("admission", queue_timeout_s=self.queue_timeout_s,
                 retry_after_s=self.retry_after_s)


@dataclass(frozen=True, slots=True)
class PDConfig:
    """Prefill/decode disaggregation (architecture §7; ``docs/pd.md``).

    A model is served disaggregated while it has a routable ``prefill`` and a routable
    ``decode`` worker of its engine (``enabled`` false: PD workers are ignored).

    ``prefill_timeout_s``: the prefill leg, from send to its complete answer (SGLang: the
    bootstrap handshake, the prefill and the KV transfer; vLLM: the prefill).
    ``decode_timeout_s``: the decode leg, from send to its first byte for the client (a
    stream's first event; a non-streamed answer's whole body).
    ``max_attempts``: pairs tried before the first byte (each with fresh bootstrap rooms).
    ``fallback_to_regular``: a failed handoff runs once, cold, on the model's ``regular``
    workers when it has some.
    ``local_prefill_max_tokens``: conditional disaggregation (vLLM): the decode worker
    prefills itself when the part of the prompt it does not hold cached is below this many
    tokens *and* at most ``local_prefill_max_ratio`` of the prompt; 0 = always disaggregate.
    ``vllm_stream_prefill``: the vLLM prefill leg is streamed (vLLM >= 0.33 puts the
    ``kv_transfer_params`` in the final chunk); off: one JSON answer.
    """

    enabled: bool = True
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 300.0
    max_attempts: int = 2
    fallback_to_regular: bool = True
    local_prefill_max_tokens: int = 0
    local_prefill_max_ratio: float = 1.0
    vllm_stream_prefill: bool = False

    def __post_init__(self) -> None:
        positive("pd", prefill_timeout_s=self.prefill_timeout_s,
                 decode_timeout_s=self.decode_timeout_s, max_attempts=self.max_attempts)
        non_negative("pd", local_prefill_max_tokens=self.local_prefill_max_tokens)
        if not 0.0 <= self.local_prefill_max_ratio <= 1.0:
            raise ConfigError("pd.local_prefill_max_ratio: must be in [0, 1], got "
                              f"{self.local_prefill_max_ratio!r}")


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """How prompts become token ids off the request's critical path (docs/gateway.md).

    ``encoder``: which implementation turns text into ids — ``auto`` (``fastokens`` for a model
    whose ``tokenizer.json`` it reproduces exactly in a parity probe at load, else Hugging Face
    ``tokenizers``), ``hf`` or ``fastokens`` (start-up fails unless the probe passes);
    docs/chat.md. ``lazy``: route on a prompt encoded only as far as the ledger match can reach,
    the rest encoded after the decision (docs/gateway.md); ``follow_ms``: how long a request
    whose walk ends where a just-routed request's walk ended (a burst of one new prompt) waits
    for that request's rest to be encoded, to be credited as far as the prompts agree.
    ``workers``: cores that encode a long
    never-seen prompt in parallel (0 = the cores this process may run on); ``pool``: ``threads``
    (GIL released while encoding) or ``processes``. ``offload_chars``: uncached prompt text
    (characters) above which encoding leaves the event loop. ``inline_rest_bytes``: the rest of
    a lazily walked prompt (UTF-8 bytes) up to which it is encoded on the event loop at once
    instead of on the feeder thread (a thread hop costs ~50 µs of CPU and two wake-ups);
    ``None``: per encoder (``fastokens`` 4,096, where encoding costs about a hop; ``hf`` 0, as
    its encodes cost far more; docs/bench/overhead.md), 0: always on the thread.
    ``heavy_messages`` / ``heavy_chars``: chat requests with more messages or message text are
    rendered and tokenized in a worker process (a huge request must not hold the event loop).
    ``feed_answers``: relayed answers are encoded into the segment cache after the response, so
    the next turn's resent history hits — answers of at least ``feed_min_tokens`` (shorter
    ones cost less to encode on the next turn than rendering the conversation again costs
    now); at most ``feed_max_bytes`` of a response are kept for it and ``feed_queue`` feeds
    wait.
    ``self_check_interval_s`` > 0: every so often, a recent prompt is sent to a worker's
    ``/tokenize`` and the ids compared (``self_check_timeout_s`` per call).
    """

    encoder: str = "auto"
    lazy: bool = True
    follow_ms: float = 200.0
    workers: int = 0
    pool: str = "threads"
    offload_chars: int = 4_096
    inline_rest_bytes: int | None = None
    heavy_messages: int = 256
    heavy_chars: int = 1_000_000
    feed_answers: bool = True
    feed_min_tokens: int = 64
    feed_max_bytes: int = 4 * 1024 * 1024
    feed_queue: int = 64
    self_check_interval_s: float = 0.0
    self_check_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        non_negative("tokenize", follow_ms=self.follow_ms, workers=self.workers,
                     offload_chars=self.offload_chars,
                     feed_max_bytes=self.feed_max_bytes, feed_queue=self.feed_queue,
                     feed_min_tokens=self.feed_min_tokens,
                     self_check_interval_s=self.self_check_interval_s)
        if self.inline_rest_bytes is not None:
            non_negative("tokenize", inline_rest_bytes=self.inline_rest_bytes)
        positive("tokenize", heavy_messages=self.heavy_messages, heavy_chars=self.heavy_chars,
                 self_check_timeout_s=self.self_check_timeout_s)
        if self.encoder in ("threads", "processes"):  # the key's meaning before 2026-12
            raise ConfigError(f"tokenize.encoder: {self.encoder!r} is now tokenize.pool; "
                              "tokenize.encoder is auto, hf or fastokens")
        if self.encoder not in ("auto", "hf", "fastokens"):
            raise ConfigError(f"tokenize.encoder: must be auto, hf or fastokens, got "
                              f"{self.encoder!r}")
        if self.pool not in ("threads", "processes"):
            raise ConfigError(f"tokenize.pool: must be threads or processes, got {self.pool!r}")
        if self.workers == 0:
            object.__setattr__(self, "workers", _usable_cores())

"""The simulated worker's configuration: one frozen, validated object built at the edge.

Every time is in milliseconds (``*_ms``) or seconds (``*_s``) as its name says; sizes are
in tokens or blocks as their names say. Ports may be 0 (the OS picks one; the running
:class:`~cortex.sim.server.SimServer` exposes the real port).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from cortex.hashing import Engine
from cortex.kvevents.codec import ENCODER_VERSIONS

__all__ = [
    "DEFAULT_VERSIONS",
    "GENERATION_PATHS",
    "FaultConfig",
    "FaultScope",
    "Role",
    "SimConfig",
    "TimingConfig",
    "default_bootstrap_port",
]

DEFAULT_VERSIONS: dict[Engine, str] = {Engine.SGLANG: "0.5.23", Engine.VLLM: "0.33.0"}
"""Engine version whose wire formats the sim speaks when none is given."""

_VERSION = re.compile(r"\d+(\.\d+){1,3}")
_SGLANG_BOOTSTRAP_PORT = 8998
_MAX_DP_SIZE = 64

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate",
                              "/v1/messages", "/v1/responses"})
"""The generation endpoints: the default scope of the HTTP faults."""


def _padded(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.removeprefix("v").split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def default_bootstrap_port() -> int:
    """SGLang's default ``disaggregation_bootstrap_port``."""
    return _SGLANG_BOOTSTRAP_PORT


class Role(StrEnum):
    """Serving role: a regular worker, or one half of a PD pair."""

    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


class FaultScope(StrEnum):
    """Which HTTP paths ``http_down`` / ``error_rate`` / ``latency_ms`` hit (admin never)."""

    GENERATION = "generation"  # only GENERATION_PATHS: health and load probes still answer
    ALL = "all"  # every engine path, probes included

    def covers(self, path: str) -> bool:
        return self is FaultScope.ALL or path in GENERATION_PATHS


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _port(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ValueError(f"{name} must be in [0, 65535], got {value}")


@dataclass(frozen=True, slots=True)
class TimingConfig:
    """Cost model: cache hits show up as a shorter time to first token.

    TTFT = admission queueing + prefill-lane queueing + ``prefill_overhead_ms``
    + ``prefill_ms_per_uncached_token`` * uncached prompt tokens; then
    ``decode_ms_per_token`` per further output token. Tokens loaded back from the host tier
    cost ``host_load_ms_per_token`` each inside the prefill: a quarter of a recompute by
    default, the ratio of the gateway's default ``host_hit`` weight (docs/gateway.md
    "Memory tiers": ``1 - load/recompute = 0.75``). Prefills run one at a time
    (a GPU runs one prefill batch at a time); decodes of running requests overlap.
    ``zero_cost`` skips every sleep (overhead benchmarks).
    """

    prefill_ms_per_uncached_token: float = 0.02
    prefill_overhead_ms: float = 2.0
    decode_ms_per_token: float = 5.0
    host_load_ms_per_token: float = 0.005
    zero_cost: bool = False

    def __post_init__(self) -> None:
        _non_negative("prefill_ms_per_uncached_token", self.prefill_ms_per_uncached_token)
        _non_negative("host_load_ms_per_token", self.host_load_ms_per_token)
        _non_negative("prefill_overhead_ms", self.prefill_overhead_ms)
        _non_negative("decode_ms_per_token", self.decode_ms_per_token)


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Faults armed at start-up; the admin endpoint changes them at run time.

    ``drop_batches`` / ``duplicate_batches`` / ``reorder_batches``: the next N event
    batches are dropped (seq gap; still replayable), sent twice, or swapped with the
    batch after them. ``http_down``: requests hang unanswered. ``error_rate``:
    probability in [0, 1] that a request gets ``error_status``. ``latency_ms``: added
    before a request is handled. These three hit the paths of ``fault_paths``
    (:class:`FaultScope`; admin paths never). ``cut_stream_after``: a streaming response
    is cut (connection closed, no ``[DONE]``) after k chunks. ``stall_stream_after``: a
    streaming response stops after k chunks (0: right after its headers) with the
    connection held open, until the fault is cleared or the client goes away — a hung engine.
    ``max_running``: at most this many requests in service per rank (``None``: the
    configured ``max_running``), the rest queue — a saturated engine, busy but progressing.
    """

    drop_batches: int = 0
    duplicate_batches: int = 0
    reorder_batches: int = 0
    http_down: bool = False
    error_rate: float = 0.0
    error_status: int = 500
    latency_ms: float = 0.0
    cut_stream_after: int | None = None
    stall_stream_after: int | None = None
    max_running: int | None = None
    fault_paths: FaultScope = FaultScope.GENERATION

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "fault_paths", FaultScope(self.fault_paths))
        except ValueError:
            raise ValueError(f"fault_paths must be one of {[s.value for s in FaultScope]}, "
                             f"got {self.fault_paths!r}") from None
        _non_negative("drop_batches", self.drop_batches)
        _non_negative("duplicate_batches", self.duplicate_batches)
        _non_negative("reorder_batches", self.reorder_batches)
        _non_negative("latency_ms", self.latency_ms)
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {self.error_rate}")
        if not 400 <= self.error_status <= 599:
            raise ValueError(f"error_status must be a 4xx/5xx code, got {self.error_status}")
        for name in ("cut_stream_after", "stall_stream_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything one simulated worker needs; validated on creation.

    ``kv_events_port``: ZMQ PUB port (0 = any free port). ``replay_port``: replay
    ROUTER port, ``None`` = no replay socket. ``bootstrap_port``: SGLang prefill's
    bootstrap HTTP server (``None`` = SGLang's default 8998; 0 = any free port).
    ``transfer_port``: the prefill's KV side channel (ZMQ ROUTER) that decode sims
    pull from (0 = any free port). ``advertise_host``: the host peers should dial
    when ``host`` is a wildcard. ``output_tokens``: range of the natural answer
    length in tokens (where the seeded text generator emits EOS). ``dp_size``:
    data-parallel ranks, each with its own KV pool of ``kv_capacity_blocks`` blocks, its
    own prefix cache and its own KV-event PUB / replay on ``kv_events_port + rank`` /
    ``replay_port + rank``. ``api_key``: like ``--api-key`` of the engines: every path but
    the probes (``/health``, ``/health_generate``, ``/ping``, ``/metrics``, ``/version``)
    and ``/sim/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
    ``eagle_lookahead``: speculative decoding with prefix caching, in
    tokens after each block that its reuse needs (0: off). vLLM (0.33): EAGLE block hashes,
    1 for EAGLE-family drafters, the number of speculative tokens for multi-module MTP; the
    stores carry ``lookahead_token_ids``. SGLang: its EAGLE radix cache keys pages by bigrams
    (1 only), published as token pairs, and matches one token less of the prompt.
    ``eagle_drop``: vLLM EAGLE with its legacy block hashes (what it runs with a KV
    connector, or ``disable_lookahead_block_hashes``): plain events, and a lookup drops the
    last block it matched. ``host_capacity_blocks``: the host tier per rank, where blocks
    evicted from the GPU are offloaded (0 = none; :mod:`cortex.sim.host`).
    ``lora_adapters``: LoRA adapter names served on top of ``model`` (listed in
    ``/v1/models`` with ``parent``; vLLM takes one as ``model``, SGLang as ``lora_path``).
    """

    engine: Engine = Engine.SGLANG
    engine_version: str = ""
    role: Role = Role.REGULAR
    host: str = "127.0.0.1"
    port: int = 0
    kv_events_port: int = 0
    replay_port: int | None = 0
    topic: str = ""
    model: str = "cortex-sim"
    tokenizer: str | None = None
    chat_template: str | None = None
    block_size: int = 16
    kv_capacity_blocks: int = 4096
    max_running: int = 64
    max_model_len: int = 131072
    buffer_steps: int = 10_000
    timing: TimingConfig = field(default_factory=TimingConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    bootstrap_port: int | None = None
    transfer_port: int = 0
    bootstrap_timeout_s: float = 300.0
    transfer_timeout_s: float = 300.0
    kv_hold_timeout_s: float = 480.0
    seed: int = 0
    output_tokens: tuple[int, int] = (16, 64)
    advertise_host: str | None = None
    engine_id: str | None = None
    dp_size: int = 1
    host_capacity_blocks: int = 0
    lora_adapters: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    eagle_lookahead: int = 0
    eagle_drop: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine(self.engine))
        object.__setattr__(self, "role", Role(self.role))
        if not self.engine_version:
            object.__setattr__(self, "engine_version", DEFAULT_VERSIONS[self.engine])
        if not _VERSION.fullmatch(self.engine_version.removeprefix("v")):
            raise ValueError(f"engine_version must look like 0.5.23, got {self.engine_version!r}")
        supported = {_padded(v): v for v in ENCODER_VERSIONS[self.engine]}
        canonical = supported.get(_padded(self.engine_version))
        if canonical is None:
            raise ValueError(
                f"no {self.engine.value} {self.engine_version} wire format; supported: "
                f"{', '.join(ENCODER_VERSIONS[self.engine])}")
        object.__setattr__(self, "engine_version", canonical)
        for name in ("port", "kv_events_port", "replay_port", "bootstrap_port", "transfer_port"):
            _port(name, getattr(self, name))
        if not self.model:
            raise ValueError("model must be a non-empty name")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_capacity_blocks < 1:
            raise ValueError(f"kv_capacity_blocks must be >= 1, got {self.kv_capacity_blocks}")
        object.__setattr__(self, "lora_adapters", tuple(self.lora_adapters))
        if any(not a or a == self.model for a in self.lora_adapters):
            raise ValueError("lora_adapters must be non-empty names other than the model's")
        if self.host_capacity_blocks < 0:
            raise ValueError(f"host_capacity_blocks must be >= 0, got {self.host_capacity_blocks}")
        if self.host_capacity_blocks and self.version_tuple < (
                (0, 11) if self.engine is Engine.VLLM else (0, 5, 9)):
            raise ValueError("a host tier needs an engine version that names media "
                             "(vLLM >= 0.11, SGLang >= 0.5.9)")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "kv_hold_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        low, high = self.output_tokens
        if not 1 <= low <= high:
            raise ValueError(f"output_tokens must be 1 <= min <= max, got {self.output_tokens}")
        if self.bootstrap_port is not None and self.engine is not Engine.SGLANG:
            raise ValueError("bootstrap_port is an SGLang option (vLLM PD uses kv_transfer_params)")
        if not 0 <= self.eagle_lookahead <= self.block_size:
            raise ValueError("eagle_lookahead must be in [0, block_size] (vLLM refuses MTP"
                             f" lookahead past one block), got {self.eagle_lookahead}")
        if self.eagle_lookahead > 1 and self.engine is Engine.SGLANG:
            raise ValueError("SGLang EAGLE pages are bigrams: eagle_lookahead must be 0 or 1")
        if self.eagle_lookahead and self.engine is Engine.VLLM and self.version_tuple < (0, 33):
            raise ValueError("vLLM publishes lookahead_token_ids from 0.33.0 on")
        if self.eagle_drop and (self.engine is not Engine.VLLM or self.eagle_lookahead):
            raise ValueError("eagle_drop is vLLM EAGLE without lookahead hashes"
                             " (eagle_lookahead 0)")
        if not 1 <= self.dp_size <= _MAX_DP_SIZE:
            raise ValueError(f"dp_size must be in [1, {_MAX_DP_SIZE}], got {self.dp_size}")
        for name in ("kv_events_port", "replay_port"):
            base = getattr(self, name)
            if base and base + self.dp_size - 1 > 65535:
                raise ValueError(f"{name} + dp_size - 1 must be <= 65535")

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.engine_version.split("."))

    @property
    def public_host(self) -> str:
        """The host peers dial: ``advertise_host``, else ``host`` unless it is a wildcard."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def runs_bootstrap_server(self) -> bool:
        return self.engine is Engine.SGLANG and self.role is Role.PREFILL

    @property
    def caches_prefixes(self) -> bool:
        """SGLang decode runs without a radix cache (its default); every other role caches."""
        return not (self.engine is Engine.SGLANG and self.role is Role.DECODE)

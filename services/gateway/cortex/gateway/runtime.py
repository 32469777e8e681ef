"""``Runtime``: one gateway process's state and background work, owned by one ``async with``.

:meth:`Runtime.load` loads the tokenizers (off the event loop) and builds every part — the
router, the dispatcher, the ledger clients — before anything starts, so a part is never
missing while the app takes requests. Entering it starts them.

Startup order: registry → upstream session → ledger replica and index client →
static workers seeded (unless an operator removed them: a tombstone) → registry watcher →
first health probes (so a gateway with reachable workers is ready when startup ends) →
background loops (pool sync, probes, load polls, status). Shutdown unwinds the same stack;
background loops are cancelled first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Collection, Mapping
from enum import StrEnum
from types import TracebackType

from cortex.chat import EncoderChoice
from cortex.chat.encoder import hf_encoder
from cortex.chat.messages_api import MessagesOptions, messages_options
from cortex.edge.tasks import stop_tasks
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig
from cortex.gateway.dispatch.dispatcher import Dispatcher
from cortex.gateway.errors import ConfigError
from cortex.gateway.fleet.health import HealthMonitor
from cortex.gateway.fleet.load import LoadPoller
from cortex.gateway.fleet.pool import WorkerPool
from cortex.gateway.fleet.seeding import UrlSeeder
from cortex.gateway.http.auth import WorkerCredentials
from cortex.gateway.http.messages import Admission
from cortex.gateway.ledger.index_client import IndexClient
from cortex.gateway.ledger.replica_client import ReplicaClient
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import Admit
from cortex.gateway.routing.router import Router
from cortex.gateway.tokens.prompt import PromptTokenizer
from cortex.gateway.upstream.client import UpstreamClient
from cortex.gateway.upstream.images import ImageHeaders
from cortex.ledger import cores
from cortex.ledger.grpc import read_token
from cortex.ledger.model import LedgerState
from cortex.ledger.replica import ReplicaChanges
from cortex.registry import (
    Assertion,
    MemoryRegistry,
    RedisRegistry,
    Registry,
    RegistryUnavailable,
    RegistryWatcher,
    SpecError,
    WorkerSpec,
)
from cortex.telemetry.tracing import Tracing

__all__ = ["Degradation", "Readiness", "Runtime"]

log = logging.getLogger(__name__)


_BLOCK_REASONS = ("engine_mismatch", "block_size_mismatch", "ledger_misaligned")


class Readiness(StrEnum):
    READY = "ready"
    DEGRADED = "degraded"  # can route, without something (see Degradation)
    UNAVAILABLE = "unavailable"  # cannot route at all


class Degradation(StrEnum):
    NO_INDEX = "no_index"  # no ledger: neither the replica nor the index answers
    NO_REPLICA = "no_replica"  # the ledger replica is not synced: Match goes over gRPC
    NO_REDIS = "no_redis"
    NO_READY_LEDGER = "no_ready_ledger"


def _index_token(path: str) -> str | None:
    if not path:
        return None
    try:
        return read_token(path)
    except ValueError as exc:
        raise ConfigError(f"index.token_file: {exc}") from None


async def load_tokenizers(config: GatewayConfig) -> dict[str, PromptTokenizer]:
    """Each model's tokenizer, loaded in a worker thread. ``tokenize.encoder`` auto: with
    ``tokenizers`` at once (the fastokens probe runs once the gateway started); fastokens:
    probed first, a failure stops the start (:class:`ConfigError`)."""
    choice = EncoderChoice(config.tokenize.encoder)
    tokenizers: dict[str, PromptTokenizer] = {}
    for model in config.models:
        try:
            tokenizer = await asyncio.to_thread(
                PromptTokenizer.load, model.tokenizer, model.chat_template,
                model.tokenize_cache_tokens,
                encoder=EncoderChoice.HF if choice is EncoderChoice.AUTO else choice)
        except ValueError as exc:  # tokenize.encoder fastokens and it is not exact
            raise ConfigError(f"model {model.name}: {exc}") from None
        if choice is EncoderChoice.AUTO:
            tokenizer.use_encoder(hf_encoder(tokenizer.chat.tokenizer,
                                             "auto: the fastokens probe is running"))
        tokenizers[model.name] = tokenizer
    return tokenizers


class Runtime:
    """Use as ``async with await Runtime.load(config) as gw``; the ASGI app reads its parts.

    ``registry``: inject one (tests, a launcher sharing a MemoryRegistry); by default Redis
    when ``registry.redis_url`` is set, else an in-process registry.
    """

    @classmethod
    async def load(cls, config: GatewayConfig, *, registry: Registry | None = None,
                   environ: Mapping[str, str] | None = None) -> Runtime:
        """A runtime with every part built, its tokenizers loaded first."""
        return cls(config, await load_tokenizers(config), registry=registry, environ=environ)

    def __init__(self, config: GatewayConfig, tokenizers: Mapping[str, PromptTokenizer], *,
                 registry: Registry | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.api_keys = config.auth.load()  # ConfigError: a bad keys file
        # the workers' API keys come from this process's environment (a snapshot taken at
        # the edge) or files it can read; never from the registry
        self.credentials = WorkerCredentials(environ or {})
        self.metrics = GatewayMetrics()
        self.pool = WorkerPool(config.breaker, forget_after_s=config.registry.forget_after_s)
        self.admission = admission = Admission(config.admission)
        self.metrics.admission_active.set_function(lambda: admission.active)
        self.metrics.admission_waiting.set_function(lambda: admission.waiting)
        self.registry: Registry = registry or self._make_registry()
        self._own_registry = registry is None
        self.tokenizers = dict(tokenizers)
        self._probed: dict[str, MessagesOptions] = {}
        for name, tokenizer in self.tokenizers.items():
            self.metrics.tokenize_encoder.labels(model=name, encoder=tokenizer.encoder.name).set(1)
        self.upstream = UpstreamClient(config.upstream, self.credentials)
        self.addresses = config.discovery.address_policy
        self._refused: dict[str, WorkerSpec] = {}  # ignored specs, logged once each
        self._admitted: dict[str, WorkerSpec] = {}  # specs the address policy let in
        self.index: IndexClient | None = None
        self.replica: ReplicaClient | None = None
        if config.index.targets:
            token = _index_token(config.index.token_file)
            if config.index.replica:
                self.replica = ReplicaClient(
                    config.index, tuple(m.domain.model for m in config.models), self.metrics,
                    self._on_replica_changes, replica_id=f"gateway@{socket.gethostname()}",
                    token=token)
            self.index = IndexClient(config.index, self.metrics, self._on_ledgers,
                                     self._poll_ledgers, token)
        self.router = Router(config, self.pool, self.tokenizers, self.index, self.metrics,
                             self.replica)
        # every entry's request validation: inference, /admin/explain, the endpoint picker
        self.admit = Admit(config, self.pool.context_length, self.pool.adapter_base,
                           self._messages_options)
        self.limits = self.admit.limits
        self.dispatcher = Dispatcher(self.pool, self.upstream, self.router, config.upstream,
                                     self.metrics, config.pd)
        self.watcher: RegistryWatcher | None = None
        self.health: HealthMonitor | None = None
        self.loads: LoadPoller | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self.draining = False  # SIGTERM: readiness says 503, requests are still served
        tracing = config.tracing
        self.tracing: Tracing | None = Tracing(
            tracing.endpoint, tracing.service_name, sample_ratio=tracing.sample_ratio,
            export_interval_s=tracing.export_interval_s,
            export_timeout_s=tracing.export_timeout_s, batch_size=tracing.batch_size,
            max_queue=tracing.max_queue,
            attributes={"service.instance.id": config.gateway_id}) if tracing.enabled else None

    def drain(self) -> None:
        """Start draining: readiness turns 503 and answers close their connections, so
        load balancers and keep-alive clients move to other replicas."""
        if not self.draining:
            self.draining = True
            self.metrics.draining.set(1)
            log.info("draining: readiness is now 503")

    def _make_registry(self) -> Registry:
        cfg = self.config.registry
        if cfg.redis_url:
            return RedisRegistry(cfg.redis_url, default_ttl_s=cfg.lease_ttl_s)
        return MemoryRegistry(default_ttl_s=cfg.lease_ttl_s)

    # ---- lifecycle ----

    async def __aenter__(self) -> Runtime:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        config = self.config
        for tokenizer in self.tokenizers.values():
            await self.router.tokenization.warm(tokenizer.encoder)
        if EncoderChoice(config.tokenize.encoder) is EncoderChoice.AUTO:
            self._tasks.append(asyncio.create_task(self._probe_encoders(),
                                                   name="gateway-encoder-probe"))
        if self._own_registry:
            await self._stack.enter_async_context(self.registry)
        await self._stack.enter_async_context(self.upstream)
        if any(m.image_headers for m in config.models):  # URL images' sizes, bounded reads
            self.router.image_headers = await self._stack.enter_async_context(ImageHeaders())
        if self.replica is not None:
            await self._stack.enter_async_context(self.replica)
        if self.index is not None:
            await self._stack.enter_async_context(self.index)
        await self._seed()
        seeds = asyncio.create_task(UrlSeeder(config.discovery, self._seed_one).run(),
                                    name="gateway-seeds")
        self._tasks.append(seeds)
        # the seeds that answer at once are in the pool at start; a slow one does not hold it
        await asyncio.wait([seeds], timeout=config.discovery.timeout_s)
        self.watcher = await self._stack.enter_async_context(
            RegistryWatcher(self.registry, interval_s=config.registry.poll_interval_s))
        self.health = HealthMonitor(self.pool, self.upstream, self.registry,
                                    config.health, config.registry.lease_ttl_s, self.metrics,
                                    on_round=self.sync_pool, on_return=self.watcher.poke,
                                    auth=self.upstream.auth)
        loads = self.loads = LoadPoller(self.pool, self.upstream, config.load,
                                        self.metrics, self.upstream.auth)
        added = self.sync_pool()
        await self.health.probe_all(w for w in self.pool if w.id in added)
        await loads.poll_all(w for w in self.pool if w.routable())
        self._tasks += [
            asyncio.create_task(self._pool_loop(), name="gateway-pool"),
            asyncio.create_task(self.health.run(), name="gateway-health"),
            asyncio.create_task(loads.run(), name="gateway-load"),
            asyncio.create_task(self.dispatcher.watch.run(self.pool, self.upstream,
                                                          self.metrics),
                                name="gateway-progress"),
            asyncio.create_task(self._status_loop(), name="gateway-status"),
        ]
        log.info("gateway started: %d models, %d workers, index=%s ledger_core=%s",
                 len(config.models), len(self.pool), self.index, cores.active())

    async def _probe_encoders(self) -> None:
        """``tokenize.encoder: auto``: each model's tokenizer switches to ``fastokens`` once
        its parity probe passed (a worker thread); otherwise it stays with ``tokenizers``
        and the reason is kept for ``/admin/models``."""
        for name, tokenizer in self.tokenizers.items():
            try:
                chat = await asyncio.to_thread(tokenizer.chat.choose_encoder, EncoderChoice.AUTO)
            except (OSError, ValueError) as exc:
                log.warning("model %s: no encoder probe: %s", name, exc)
                continue
            previous = tokenizer.encoder.name
            assert chat.encoder is not None
            await self.router.tokenization.warm(chat.encoder)
            tokenizer.use_encoder(chat.encoder)
            gauge = self.metrics.tokenize_encoder
            gauge.labels(model=name, encoder=previous).set(0)
            gauge.labels(model=name, encoder=chat.encoder.name).set(1)

    async def _stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks)
        await self._stack.aclose()
        self.router.close()
        if self.tracing is not None:  # what is queued goes out (bounded by its timeout)
            await asyncio.to_thread(self.tracing.shutdown)

    # ---- registry → pool ----

    async def _seed(self) -> None:
        """Write the static workers (``config.workers``) into the registry, over what is
        there, unless an operator removed them (their tombstone wins)."""
        for spec in self.config.workers:
            await self._seed_one(spec)

    async def _seed_one(self, spec: WorkerSpec) -> None:
        try:
            outcome = await self.registry.reassert(spec, self.config.registry.lease_ttl_s,
                                                   replace=True)
        except RegistryUnavailable as exc:
            log.warning("cannot seed worker=%s into the registry: %s", spec.id, exc,
                        extra={"worker": spec.id})
            return
        if outcome is Assertion.TOMBSTONED:
            log.warning("not seeding worker=%s: an operator removed it (tombstone)",
                        spec.id, extra={"worker": spec.id})
        elif self.watcher is not None:
            self.watcher.poke()

    def _registry_view(self) -> tuple[Mapping[str, WorkerSpec], Collection[str], float | None]:
        """The registry's workers and tombstones as last seen, and when that view was
        requested (monotonic s)."""
        watcher = self.watcher
        if watcher is None or (watcher.polls and watcher.last_ok_monotonic is None):
            # the registry was never readable: serve the static seeds
            return self._allowed({s.id: s for s in self.config.workers}), (), None
        return (self._allowed(watcher.workers), watcher.tombstones.keys(),
                watcher.view_taken_at)

    def _allowed(self, specs: Mapping[str, WorkerSpec]) -> Mapping[str, WorkerSpec]:
        """``specs`` without those on a refused address (each logged once). A spec let in
        at the previous call is not checked again (this runs after every probe round)."""
        admitted, self._admitted = self._admitted, {}
        for worker_id, spec in specs.items():
            if admitted.get(worker_id) != spec:
                try:
                    self.addresses.check(spec)
                except SpecError as exc:
                    if self._refused.get(worker_id) != spec:
                        self._refused[worker_id] = spec
                        log.warning("worker %s ignored: %s", worker_id, exc,
                                    extra={"worker": worker_id})
                    continue
            self._admitted[worker_id] = spec
        return dict(self._admitted)

    def sync_pool(self) -> list[str]:
        """Reconcile the pool with the registry (and the workers' health); returns the ids
        added. Workers that left lose their routing state and metric series."""
        added, removed = self.pool.sync(*self._registry_view())
        if added or removed:
            log.info("worker pool changed: added=%s removed=%s", added, removed)
        for worker_id in added:
            self.metrics.welcome_worker(worker_id)
        for worker_id in removed:
            self.metrics.forget_worker(worker_id)
        if removed:
            self.router.forget_workers(removed)
        return added

    async def _pool_loop(self) -> None:
        assert self.watcher is not None and self.health is not None and self.loads is not None
        version = self.watcher.version
        while True:
            version = await self.watcher.wait_changed(version)
            added = self.sync_pool()
            # new workers, and those whose entry vanished: probe now (the probe re-asserts)
            urgent = [w for w in self.pool if w.id in added or not w.registered]
            if urgent:
                await self.health.probe_all(urgent)
                await self.loads.poll_all(w for w in urgent if w.id in added and w.routable())

    async def _status_loop(self) -> None:
        while True:
            if self.replica is not None and self.replica.usable:
                self._on_ledgers(self._replica_states())
            self.readiness()
            self._publish_alignment()
            await asyncio.sleep(1.0)

    def _publish_alignment(self) -> None:
        """Per model: can exact KV routing work, and which workers are denied credit why."""
        index_up = self._ledger_usable()
        for model in self.config.models:
            blocked = dict.fromkeys(_BLOCK_REASONS, 0)
            creditable = 0
            for w in self.pool:
                if w.spec.model != model.name:
                    continue
                if w.spec.engine is not model.engine:
                    blocked["engine_mismatch"] += 1
                elif w.spec.block_size is not None and w.spec.block_size != model.block_size:
                    blocked["block_size_mismatch"] += 1
                elif w.ledger is LedgerState.MISALIGNED:
                    blocked["ledger_misaligned"] += 1
                else:
                    creditable += 1
            m = self.metrics
            m.exact_routing.labels(model=model.name).set(1 if index_up and creditable else 0)
            for reason, count in blocked.items():
                m.credit_blocked.labels(model=model.name, reason=reason).set(count)

    # ---- index callbacks ----

    def _on_replica_changes(self, changes: ReplicaChanges) -> None:
        self.router.on_replica_changes(changes)
        self._on_ledgers(self._replica_states())

    def _poll_ledgers(self) -> bool:
        """Ledger states come from the index only while the replica cannot tell them."""
        return self.replica is None or not self.replica.usable

    def _replica_states(self) -> dict[str, LedgerState]:
        """Each worker's best device ledger state in the replica (READY if any rank's is;
        offload tiers only extend a device prefix)."""
        assert self.replica is not None
        states: dict[str, LedgerState] = {}
        for source, state in self.replica.replica.states().items():
            if source.tier:
                continue
            if states.get(source.worker_id) is not LedgerState.READY:
                states[source.worker_id] = state
        return states

    def _messages_options(self, model: ModelConfig) -> MessagesOptions:
        """What ``model``'s engine probes from its chat template for ``/v1/messages``
        (computed once per model)."""
        found = self._probed.get(model.name)
        if found is None:
            found = self._probed[model.name] = messages_options(
                self.tokenizers[model.name].chat, model.engine)
        return found

    def _on_ledgers(self, states: dict[str, LedgerState]) -> None:
        for worker in self.pool:
            worker.ledger = states.get(worker.id, LedgerState.UNSPECIFIED)

    # ---- status ----

    def _ledger_usable(self) -> bool:
        """Routing can read the ledger: from the replica, or from the index over gRPC."""
        return (self.replica is not None and self.replica.usable) or (
            self.index is not None and self.index.available)

    def degradations(self) -> list[Degradation]:
        out: list[Degradation] = []
        ledger = self._ledger_usable()
        if not ledger:
            out.append(Degradation.NO_INDEX)
        if self.replica is not None and not self.replica.usable:
            out.append(Degradation.NO_REPLICA)
        if self.watcher is None or self.watcher.degraded:
            out.append(Degradation.NO_REDIS)
        if ledger and not any(
            w.ledger is LedgerState.READY for w in self.pool if w.routable()
        ):
            out.append(Degradation.NO_READY_LEDGER)
        return out

    def readiness(self) -> tuple[Readiness, list[Degradation]]:
        """Ready while some model is servable (a routable regular worker, or a routable
        prefill and decode pair); degraded names what is missing."""
        reasons = self.degradations()
        routable = self.pool.servable()
        state = (Readiness.UNAVAILABLE if not routable
                 else Readiness.DEGRADED if reasons else Readiness.READY)
        self.metrics.ready.set(1 if routable else 0)
        self.metrics.routable_workers.set(sum(1 for w in self.pool if w.routable()))
        for reason in Degradation:
            self.metrics.degraded.labels(reason=reason.value).set(reason in reasons)
        return state, reasons

    def __repr__(self) -> str:
        return f"Runtime(models={[m.name for m in self.config.models]}, {self.pool!r})"

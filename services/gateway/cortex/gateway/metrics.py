"""Every metric the gateway exports, in one place (prefix ``cortex_gateway_``).

One :class:`GatewayMetrics` per gateway instance, each with its own collector registry, so
several in-process gateways (tests, the dev launcher) never share counters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

from cortex.ledger import cores

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FAST = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKENS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_GONE_KEPT = 10_000  # departed worker ids remembered so late updates do not revive series


class _Noop:
    """Stands in for the series of a worker that left: late updates go nowhere."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


_NOOP = _Noop()


PREFIX = "cortex_gateway_"


class GatewayMetrics:
    """The gateway's Prometheus metrics (names are part of the operator contract)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # the standard process_* series
        self._requests(r)
        self._routing(r)
        self._replica(r)
        self._truth_check(r)
        self._reuse(r)
        self._upstream(r)
        self._pd(r)
        self._workers(r)
        self._status(r)
        self._epp(r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._per_worker: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()

    def _requests(self, r: CollectorRegistry) -> None:
        # Requests
        p = PREFIX
        self.requests = Counter(p + "requests_total", "Inference requests answered, by "
                                "endpoint, status and model (a served one, else 'unknown')",
                                ["endpoint", "status", "model"], registry=r)
        self.request_seconds = Histogram(p + "request_duration_seconds",
                                         "Time from request to end of response",
                                         ["endpoint", "model"], buckets=_SLOW, registry=r)
        self.auth_failures = Counter(p + "auth_failures_total",
                                     "Requests refused 401, by reason (missing|invalid key)",
                                     ["reason"], registry=r)
        self.key_requests = Counter(p + "key_requests_total",
                                    "Requests authenticated with each API key (by key id)",
                                    ["key"], registry=r)
        self.rejected = Counter(p + "rejected_total", "Requests rejected before routing",
                                ["code"], registry=r)
        self.client_disconnects = Counter(p + "client_disconnects_total",
                                          "Clients gone before the response ended", registry=r)
        self.inflight = Gauge(p + "inflight_requests", "Requests being served", registry=r)
        # client connections (cortex.gateway.http.listener / .connection)
        self.connections_open = Gauge(p + "connections_open", "Client connections open",
                                      registry=r)
        self.connection_peers = Gauge(p + "connection_peers",
                                      "Client addresses with a connection open", registry=r)
        self.connections_refused = Counter(p + "connections_refused_total",
                                           "Client connections answered 503 and closed at "
                                           "accept, by bound (total|peer)", ["bound"],
                                           registry=r)
        self.connections_timed_out = Counter(p + "connections_timed_out_total",
                                             "Client connections closed by a deadline, by "
                                             "phase (header: no request in time; write: "
                                             "the client stopped reading)", ["phase"],
                                             registry=r)
        self.admission_active = Gauge(p + "admission_active",
                                      "Inference requests holding an admission slot",
                                      registry=r)
        self.admission_waiting = Gauge(p + "admission_waiting",
                                       "Inference requests queued for an admission slot",
                                       registry=r)
        self.admission_rejected = Counter(p + "admission_rejected_total",
                                          "Requests refused by admission control, by code "
                                          "(queue_full|queue_timeout)", ["code"], registry=r)
        self.admission_wait_seconds = Histogram(p + "admission_wait_seconds",
                                                "Time admitted requests waited for a slot",
                                                buckets=_SLOW, registry=r)
        self.ttft = Histogram(p + "ttft_seconds",
                              "Request arrival to the first byte of a 200 answer sent to the "
                              "client (streams: the first event, i.e. time to first token), by "
                              "model, stream (true|false) and match mode",
                              ["model", "stream", "mode"], buckets=_TTFT, registry=r)

    def _routing(self, r: CollectorRegistry) -> None:
        # Routing
        p = PREFIX
        self.routing_seconds = Histogram(p + "routing_seconds",
                                         "Routing decision time by stage",
                                         ["stage"], buckets=_FAST, registry=r)
        self.decisions = Counter(p + "decisions_total", "Routing decisions",
                                 ["mode", "reason"], registry=r)
        self.prompt_tokens = Histogram(p + "prompt_tokens", "Prompt tokens per routed request",
                                       buckets=_TOKENS, registry=r)
        self.tokenize_cache = Counter(p + "tokenize_cache_total",
                                      "Prompt segments served from / missing in the cache",
                                      ["result"], registry=r)
        self.tokenize_cache_tokens = Counter(p + "tokenize_cache_tokens_total",
                                             "Prompt tokens served from (hit) or encoded into "
                                             "(miss) the segment cache, by model",
                                             ["model", "result"], registry=r)
        self.tokenize_cache_entries = Gauge(p + "tokenize_cache_segments",
                                            "Pieces held by the segment cache", ["model"],
                                            registry=r)
        self.tokenize_cache_bytes = Gauge(p + "tokenize_cache_bytes",
                                          "Bytes held by the segment cache", ["model"],
                                          registry=r)
        self.tokenize_cache_evictions = Counter(p + "tokenize_cache_evictions_total",
                                                "Pieces evicted from the segment cache",
                                                ["model"], registry=r)
        self.tokenize_offloaded = Counter(p + "tokenize_offloaded_total",
                                          "Prompts tokenized off the event loop, by lane "
                                          "(parallel: never-seen text on worker threads; "
                                          "heavy: rendered and tokenized in a worker process)",
                                          ["model", "lane"], registry=r)
        self.tokenize_answer_feeds = Counter(p + "tokenize_answer_feeds_total",
                                             "Relayed answers encoded into the segment cache "
                                             "after the response, by result (fed|short|dropped|"
                                             "skipped|failed)", ["model", "result"], registry=r)
        self.tokenize_encoder = Gauge(p + "tokenize_encoder",
                                      "1 for the implementation encoding a model's prompts "
                                      "(fastokens where its load-time parity probe passed, "
                                      "else hf); the reason is in the log and /admin/models",
                                      ["model", "encoder"], registry=r)
        self.tokenize_lazy_rest = Counter(p + "tokenize_lazy_rest_total",
                                          "Prompt rests encoded after a lazy walk, by "
                                          "result (inline: at once, small; done: on the "
                                          "feeder thread; shed|failed)",
                                          ["model", "result"], registry=r)
        self.response_owner_probes = Counter(p + "response_owner_probes_total",
                                             "Response ids not seen here looked for on the "
                                             "workers, by result (found|none)", ["result"],
                                             registry=r)
        self.tokenize_lazy_follow = Counter(p + "tokenize_lazy_follow_total",
                                            "Walks that ended where a just-routed walk ended "
                                            "and waited for its rest, by result "
                                            "(followed|timeout)", ["model", "result"],
                                            registry=r)
        self.tokenize_self_checks = Counter(p + "tokenize_self_checks_total",
                                            "Prompts re-tokenized by a worker's /tokenize and "
                                            "compared, by result (match|mismatch|error)",
                                            ["model", "worker", "result"], registry=r)
        self.match_source = Counter(p + "match_source_total",
                                    "Where routing read the ledger: replica (in process), index "
                                    "(gRPC Match while the replica is not usable) or none",
                                    ["source"], registry=r)

    def _replica(self, r: CollectorRegistry) -> None:
        # The ledger replica
        p = PREFIX
        self.replica_state = Gauge(p + "replica_state",
                                   "1 for the ledger replica's state (empty, loading, synced, "
                                   "stale)", ["state"], registry=r)
        self.replica_batches = Counter(p + "replica_batches_total",
                                       "Replica stream batches applied (snapshots, changes, "
                                       "heartbeats)", registry=r)
        self.replica_snapshots = Counter(p + "replica_snapshots_total",
                                         "Complete snapshots loaded into the replica", registry=r)
        self.replica_resyncs = Counter(p + "replica_resyncs_total",
                                       "Replica streams lost (a snapshot follows), by reason",
                                       ["reason"], registry=r)
        self.replica_lag = Histogram(p + "replica_lag_seconds",
                                     "Index applying a change to this replica applying it (s; "
                                     "wall clocks of both hosts)", buckets=_FAST, registry=r)
        self.replica_blocks = Gauge(p + "replica_blocks", "Blocks in the ledger replica",
                                    registry=r)
        self.replica_bytes = Gauge(p + "replica_bytes", "Estimated bytes of the ledger replica",
                                   registry=r)
        self.ledger_core = Gauge(p + "ledger_core", "1 for the radix hash tree core of the "
                                 "ledger replica (native: compiled; python: the fallback, ~20x "
                                 "slower)", ["core"], registry=r)
        self.ledger_core.labels(core=cores.active().value).set(1)
        self.predicted_keys = Gauge(p + "predicted_blocks", "Blocks in the predicted side index",
                                    registry=r)

    def _truth_check(self, r: CollectorRegistry) -> None:
        # Truth check: predicted vs the engine's cached_tokens
        p = PREFIX
        self.predicted_tokens = Counter(p + "predicted_cached_tokens_total",
                                        "Cached prompt tokens the gateway predicted", registry=r)
        self.actual_tokens = Counter(p + "actual_cached_tokens_total",
                                     "Cached prompt tokens the engines reported", registry=r)
        self.prediction = Counter(p + "cache_prediction_total",
                                  "Predictions checked against the engine",
                                  ["outcome"], registry=r)
        self.overpredicted_tokens = Histogram(p + "cache_overprediction_tokens",
                                              "Predicted minus reported cached tokens, when over",
                                              buckets=_TOKENS[1:], registry=r)
        self.underpredicted_tokens = Histogram(p + "cache_underprediction_tokens",
                                               "Reported minus predicted cached tokens, when under",
                                               buckets=_TOKENS[1:], registry=r)

    def _reuse(self, r: CollectorRegistry) -> None:
        # Reuse accounting (cortex.gateway.routing.scoring) and session hints
        p = PREFIX
        self.reuse_tokens = Counter(p + "reuse_tokens_total",
                                    "Prompt tokens of answered requests whose engine reported"
                                    " its cached tokens, by worker, model and kind: available"
                                    " (the longest prefix any eligible worker held, any"
                                    " tier), available_device (the same in device memory"
                                    " alone), captured"
                                    " (what the serving worker held), delivered (what the"
                                    " engine reported cached)",
                                    ["worker", "model", "kind"], registry=r)
        self.reuse_prompt_tokens = Counter(p + "reuse_prompt_tokens_total",
                                           "Prompt tokens of the requests counted in"
                                           " reuse_tokens_total (the hit-rate denominator)",
                                           ["worker", "model"], registry=r)
        self.reuse_given_up = Counter(p + "reuse_given_up_tokens_total",
                                      "Available minus captured tokens, by model and why"
                                      " (over_watermark, load, kv_pressure, retry, ...)",
                                      ["model", "reason"], registry=r)
        self.reuse_unreported = Counter(p + "reuse_unreported_total",
                                        "Answered requests whose engine reported no cached"
                                        " tokens (left out of reuse_tokens_total)",
                                        ["model"], registry=r)
        self.session_hints = Counter(p + "session_hints_total",
                                     "Requests naming a session (header or prompt_cache_key),"
                                     " by outcome: new (unknown session), kept (routed to its"
                                     " worker), moved (routed elsewhere)",
                                     ["outcome"], registry=r)
        self.sessions = Gauge(p + "sessions", "Sessions remembered in the session table",
                              registry=r)
        self.sessions_evicted = Counter(p + "sessions_evicted_total",
                                        "Sessions dropped from the full session table (least"
                                        " recently seen first)", registry=r)
        self.worker_kv_capacity = Gauge(p + "worker_kv_capacity_blocks",
                                        "A worker's KV pool as its engine reports it (blocks"
                                        " over its DP ranks)", ["worker"], registry=r)
        self.worker_kv_occupancy = Gauge(p + "worker_kv_occupancy_ratio",
                                         "Device blocks the ledger holds for a worker over"
                                         " its KV capacity, as last routed", ["worker"],
                                         registry=r)

    def _upstream(self, r: CollectorRegistry) -> None:
        # Upstream
        p = PREFIX
        self.upstream_errors = Counter(p + "upstream_errors_total", "Failed upstream attempts",
                                       ["worker", "kind"], registry=r)
        self.upstream_wedged = Counter(p + "upstream_wedged_total",
                                       "Times a worker was found wedged (attempts waited on "
                                       "it, it sent nothing, its probe went unanswered)",
                                       ["worker"], registry=r)
        self.retries = Counter(p + "retries_total", "Attempts moved to the next worker",
                               ["reason"], registry=r)
        self.upstream_ttfb = Histogram(p + "upstream_first_byte_seconds",
                                       "Request sent to a worker until its first response "
                                       "bytes of a 200 answer (streams: the first chunk; "
                                       "otherwise the whole body; PD: the decode leg), by "
                                       "worker and match mode",
                                       ["worker", "mode"], buckets=_TTFT, registry=r)

    def _pd(self, r: CollectorRegistry) -> None:
        # Prefill/decode disaggregation
        p = PREFIX
        self.pd_requests = Counter(p + "pd_requests_total",
                                   "Requests of disaggregated models by how they were served",
                                   ["engine", "outcome"], registry=r)
        self.pd_handoff_failures = Counter(p + "pd_handoff_failures_total",
                                           "Failed PD legs, by side (prefill|decode) and kind",
                                           ["engine", "side", "kind"], registry=r)
        self.pd_pairs_refused = Counter(p + "pd_pairs_refused_total",
                                        "Prefill/decode pairs not tried, by reason"
                                        " (connector_version: their KV connectors cannot talk)",
                                        ["engine", "reason"], registry=r)
        self.pd_fallbacks = Counter(p + "pd_fallbacks_total",
                                    "PD requests run cold on a regular worker, by failed side",
                                    ["engine", "reason"], registry=r)
        self.pd_cancelled_legs = Counter(p + "pd_cancelled_legs_total",
                                         "PD legs cancelled because the other leg failed",
                                         ["engine", "side"], registry=r)
        self.pd_handoff_seconds = Histogram(p + "pd_handoff_seconds",
                                            "PD attempt start to the decode leg's first byte "
                                            "(bootstrap, prefill, KV transfer, first token)",
                                            ["engine"], buckets=_SLOW, registry=r)
        self.pd_prefill_seconds = Histogram(p + "pd_prefill_seconds",
                                            "Duration of successful prefill legs",
                                            ["engine"], buckets=_SLOW, registry=r)

    def _workers(self, r: CollectorRegistry) -> None:
        # Workers
        p = PREFIX
        self.worker_inflight = Gauge(p + "worker_inflight", "Requests open on a worker",
                                     ["worker"], registry=r)
        self.worker_engine_running = Gauge(p + "worker_engine_running",
                                           "Engine-reported running requests", ["worker"],
                                           registry=r)
        self.worker_engine_waiting = Gauge(p + "worker_engine_waiting",
                                           "Engine-reported waiting requests", ["worker"],
                                           registry=r)
        self.worker_healthy = Gauge(p + "worker_healthy", "1 if the last probes passed",
                                    ["worker"], registry=r)
        self.worker_breaker_open = Gauge(p + "worker_breaker_open",
                                         "1 while the worker's circuit breaker is not closed",
                                         ["worker"], registry=r)
        self.workers = Gauge(p + "workers", "Workers in the pool by health", ["health"],
                             registry=r)
        self.probes = Counter(p + "health_probes_total", "Health probes", ["result"], registry=r)
        self.lease_renewals = Counter(p + "lease_renewals_total",
                                      "Registry lease renewals and re-assertions by result "
                                      "(renewed|created|replaced|tombstoned|gone|unavailable)",
                                      ["result"], registry=r)
        self.remembered_workers = Gauge(p + "remembered_workers",
                                        "Workers that left the pool, probed for their return",
                                        registry=r)
        self.load_polls = Counter(p + "load_polls_total", "Engine load polls", ["result"],
                                  registry=r)

    def _status(self, r: CollectorRegistry) -> None:
        # Dependencies and readiness
        p = PREFIX
        self.index_available = Gauge(p + "index_available", "1 while the index answers Match",
                                     registry=r)
        self.index_errors = Counter(p + "index_errors_total", "Failed index calls", ["kind"],
                                    registry=r)
        self.ready = Gauge(p + "ready", "1 while the gateway can route (some model has a "
                           "routable worker)", registry=r)
        self.draining = Gauge(p + "draining", "1 once the process drains (SIGTERM): readiness "
                              "is 503, requests are still served", registry=r)
        self.routable_workers = Gauge(p + "routable_workers",
                                      "Workers healthy with their breaker admitting requests",
                                      registry=r)
        self.degraded = Gauge(p + "degraded", "1 per active degradation reason", ["reason"],
                              registry=r)
        self.exact_routing = Gauge(p + "exact_routing_enabled",
                                   "1 while some worker of the model can get cache credit",
                                   ["model"], registry=r)
        self.credit_blocked = Gauge(p + "credit_blocked_workers",
                                    "Workers denied cache credit, by model and reason",
                                    ["model", "reason"], registry=r)

    def _epp(self, r: CollectorRegistry) -> None:
        # The endpoint picker (cortex gateway --epp-port: Envoy's ext_proc)
        p = PREFIX
        self.epp_picks = Counter(p + "epp_picks_total",
                                 "Endpoint picker answers, by outcome (picked|refused_<status>)",
                                 ["outcome"], registry=r)
        self.epp_served = Counter(p + "epp_served_total",
                                  "Responses whose served endpoint Envoy reported, by whether it "
                                  "was the picked one (chosen|fallback|unknown)", ["endpoint"],
                                  registry=r)
        self.epp_streams = Gauge(p + "epp_streams", "Open ext_proc streams", registry=r)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, memoized: label lookups are hot-path costs."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def worker(self, metric: Any, worker_id: str, *rest: str) -> Any:
        """The series of a per-worker ``metric`` (``worker`` its first label), removed by
        :meth:`forget_worker`; a no-op for a worker that left the pool."""
        if worker_id in self._gone:
            return _NOOP
        values = (worker_id, *rest)
        found = self._children.get((id(metric), values))
        if found is None:  # a new series: remembered for forget_worker
            self._per_worker.setdefault(worker_id, set()).add((metric, values))
            found = self.child(metric, *values)
        return found

    def forget_worker(self, worker_id: str) -> None:
        """The worker left the pool: drop every series labelled with it."""
        for metric, values in self._per_worker.pop(worker_id, ()):
            self._children.pop((id(metric), values), None)
            metric.remove(*values)
        self._gone[worker_id] = None
        if len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    def welcome_worker(self, worker_id: str) -> None:
        """The worker (re)joined the pool: its series may be created again."""
        self._gone.pop(worker_id, None)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        data: bytes = generate_latest(self.registry)
        return data

    def __repr__(self) -> str:
        return "GatewayMetrics()"

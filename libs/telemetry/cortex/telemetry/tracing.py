"""OpenTelemetry tracing for a service: spans exported over OTLP/HTTP, W3C trace context.

:class:`Tracing` owns its own ``TracerProvider`` (never the global one: several services
or gateways may share a process in tests and the dev launcher). Spans are batched on the
SDK's worker thread, so the event loop never waits for the collector; a full queue drops
spans instead of growing. Sampling is parent-based: a client's sampled ``traceparent`` is
always followed, other requests are sampled at ``sample_ratio``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["Span", "SpanKind", "StatusCode", "Tracing", "trace_headers"]

_PROPAGATOR = TraceContextTextMapPropagator()
_CONTEXT_HEADERS = ("traceparent", "tracestate")


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers among ``headers`` (lower-cased names), to pass on
    unchanged when the service does not trace itself."""
    return {name: headers[name] for name in _CONTEXT_HEADERS if name in headers}


class Tracing:
    """``Tracing(endpoint, service_name, …)``; :meth:`shutdown` flushes what is queued.

    ``endpoint``: the collector's OTLP/HTTP traces URL. ``export_interval_s`` /
    ``export_timeout_s`` / ``batch_size`` / ``max_queue``: the batch processor's schedule,
    per-export timeout, spans per export and spans queued at most.
    """

    def __init__(self, endpoint: str, service_name: str, *, sample_ratio: float = 1.0,
                 export_interval_s: float = 1.0, export_timeout_s: float = 5.0,
                 batch_size: int = 512, max_queue: int = 8192,
                 attributes: Mapping[str, str] | None = None) -> None:
        self.endpoint = endpoint
        resource = Resource.create({"service.name": service_name, **(attributes or {})})
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)), resource=resource,
            shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=export_timeout_s),
            max_queue_size=max_queue, schedule_delay_millis=export_interval_s * 1000.0,
            max_export_batch_size=min(batch_size, max_queue),
            export_timeout_millis=export_timeout_s * 1000.0))
        self._tracer = self._provider.get_tracer(service_name)

    def start(self, name: str, *, parent: Span | None = None,
              headers: Mapping[str, str] | None = None, kind: SpanKind = SpanKind.INTERNAL,
              start_ns: int | None = None, attributes: Mapping[str, Any] | None = None
              ) -> Span:
        """A started span: a child of ``parent``, else of the trace context in ``headers``
        (a request's ``traceparent``), else a new trace's root. End it with ``span.end()``."""
        context: Context | None = None
        if parent is not None:
            context = set_span_in_context(parent)
        elif headers is not None:
            context = _PROPAGATOR.extract(dict(trace_headers(headers)))
        return self._tracer.start_span(name, context=context, kind=kind, start_time=start_ns,
                                       attributes=dict(attributes or {}))

    def record(self, name: str, parent: Span, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None) -> None:
        """A finished span of ``parent`` from ``start_ns`` to ``end_ns`` (Unix ns): a stage
        whose timing was measured while it ran."""
        if not parent.is_recording():
            return
        span = self.start(name, parent=parent, start_ns=start_ns, attributes=attributes)
        span.end(end_time=end_ns)

    @staticmethod
    def headers(span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span``, for the next hop."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout) and stop. Blocking."""
        self._provider.shutdown()

    def __repr__(self) -> str:
        return f"Tracing(endpoint={self.endpoint!r})"


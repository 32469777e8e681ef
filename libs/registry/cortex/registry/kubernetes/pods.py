"""Pods → worker specs: what a labelled pod says about the engine it runs (pure).

A pod is a worker when it is Running, Ready, not being deleted and has an IP. What the
worker is comes from the pod's annotations, with labels as the fallback (label values
cannot hold a model name like ``org/model``, annotations can):

==========================  ==========================================================
``cortex/engine``           ``sglang`` or ``vllm`` (required)
``cortex/model``            the served model name (required)
``cortex/role``             ``regular`` (default), ``prefill`` or ``decode``
``cortex/port``             HTTP port (default: SGLang 30000, vLLM 8000)
``cortex/kv-events-port``   ZMQ KV-event PUB port (base: DP rank r uses port + r)
``cortex/replay-port``      ZMQ replay ROUTER port (base, as above)
``cortex/topic``            KV-event topic (default empty)
``cortex/dp-size``          data-parallel ranks (default 1)
``cortex/block-size``       tokens per KV block (default: learned from the events)
``cortex/bootstrap-port``   SGLang prefill workers' bootstrap port
==========================  ==========================================================

The worker id is ``<pod>.<namespace>``; the spec's labels record where it came from
(``source``, ``k8s.namespace``, ``k8s.pod``, ``k8s.node``, ``discovered-by``).

What the engine said about itself (:mod:`cortex.registry.engine_spec`, when the discovery
asks it) fills in what the pod does not say; the pod's annotations win. Event endpoints the
engine reports as bind addresses arrive already at the pod's IP; the engine's hash
algorithm becomes the ``hash_algo`` label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cortex.hashing import Engine
from cortex.registry.engine_spec import HASH_ALGO_LABEL
from cortex.registry.errors import SpecError
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = ["PREFIX", "NotWorker", "PodTable", "pod_url", "ready_reason", "worker_of"]

PREFIX = "cortex/"
"""Prefix of the annotations (and labels) that describe a worker pod."""

_DEFAULT_PORT = {Engine.SGLANG: 30000, Engine.VLLM: 8000}
_INTS = {"dp-size": "dp_size", "block-size": "block_size", "bootstrap-port": "bootstrap_port"}
_LEARNED = ("role", "dp_size", "kv_events", "topic", "replay", "bootstrap_port", "block_size")


@dataclass(frozen=True, slots=True)
class NotWorker:
    """Why a pod is not (or not yet) a worker. ``invalid``: it is labelled as one but its
    annotations are wrong (an operator must fix them); otherwise it is just not ready."""

    pod: str
    reason: str
    invalid: bool = False


def _field(pod: Mapping[str, Any], *path: str) -> Any:
    value: Any = pod
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def ready_reason(pod: Mapping[str, Any]) -> str | None:
    """``None`` when the pod can take requests, else why not."""
    if _field(pod, "metadata", "deletionTimestamp"):
        return "terminating"
    phase = _field(pod, "status", "phase")
    if phase != "Running":
        return f"phase {phase or 'unknown'}"
    conditions = _field(pod, "status", "conditions") or []
    if not any(isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
               for c in conditions):
        return "not Ready"
    if not _field(pod, "status", "podIP"):
        return "no pod IP"
    return None


def _netloc(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _port(text: str, key: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise SpecError(f"{PREFIX}{key}: {text!r} is not a port")
    return int(text)


def _described(pod: Mapping[str, Any]) -> dict[str, str]:
    described: dict[str, str] = {}
    for source in ("labels", "annotations"):  # annotations win
        for key, value in (_field(pod, "metadata", source) or {}).items():
            if isinstance(key, str) and key.startswith(PREFIX) and isinstance(value, str):
                described[key[len(PREFIX):]] = value.strip()
    return described


def pod_url(pod: Mapping[str, Any]) -> str | None:
    """The engine's base URL, to ask it about itself: ``None`` without an IP, or without a
    port (``cortex/port``, else the annotated engine's default)."""
    ip = _field(pod, "status", "podIP")
    described = _described(pod)
    try:
        if "port" in described:
            port = _port(described["port"], "port")
        else:
            port = _DEFAULT_PORT[Engine(described.get("engine", ""))]
    except (SpecError, ValueError):
        return None
    return f"http://{_netloc(str(ip), port)}" if ip else None


def worker_of(pod: Mapping[str, Any], discovered_by: str = "",
              learned: Mapping[str, Any] | None = None) -> WorkerSpec | NotWorker:
    """The worker ``pod`` is, or why it is none. ``discovered_by`` is recorded in the
    spec's labels, so a discovery recognises the workers it registered. ``learned``: spec
    fields the engine reported (``Discovery.learned``), under the pod's own."""
    name = str(_field(pod, "metadata", "name") or "")
    namespace = str(_field(pod, "metadata", "namespace") or "")
    try:
        spec = _spec(pod, name, namespace, _described(pod), discovered_by, learned or {})
    except SpecError as exc:
        return NotWorker(name, str(exc), invalid=True)
    reason = ready_reason(pod)
    return spec if reason is None else NotWorker(name, reason)


def _spec(pod: Mapping[str, Any], name: str, namespace: str, described: Mapping[str, str],
          discovered_by: str, learned: Mapping[str, Any]) -> WorkerSpec:
    if described.get("engine"):
        try:
            engine = Engine(described["engine"])
        except ValueError:
            raise SpecError(f"{PREFIX}engine: unknown engine {described['engine']!r}") from None
    elif isinstance(learned.get("engine"), Engine):
        engine = learned["engine"]
    else:
        raise SpecError(f"{PREFIX}engine: missing (an annotation or label)")
    model = described.get("model") or learned.get("model")
    if not isinstance(model, str) or not model:
        raise SpecError(f"{PREFIX}model: missing (an annotation or label)")
    ip = str(_field(pod, "status", "podIP") or "0.0.0.0")  # validated with a placeholder
    port = _port(described["port"], "port") if "port" in described else _DEFAULT_PORT[engine]
    fields: dict[str, Any] = {k: learned[k] for k in _LEARNED if learned.get(k) is not None}
    for key, attr in _INTS.items():
        if key in described:
            if not described[key].isdigit():
                raise SpecError(f"{PREFIX}{key}: {described[key]!r} is not a number")
            fields[attr] = int(described[key])
    for key, attr in (("kv-events-port", "kv_events"), ("replay-port", "replay")):
        if key in described:
            fields[attr] = f"tcp://{_netloc(ip, _port(described[key], key))}"
    role = _role(described["role"]) if "role" in described else fields.pop("role", None)
    if role is not WorkerRole.PREFILL or engine is not Engine.SGLANG:
        if "bootstrap-port" not in described:
            fields.pop("bootstrap_port", None)  # a learned default of SGLang prefills only
    if "topic" in described:
        fields["topic"] = described["topic"]
    labels = {"source": "kubernetes", "k8s.namespace": namespace, "k8s.pod": name,
              "k8s.node": str(_field(pod, "spec", "nodeName") or ""),
              "discovered-by": discovered_by}
    if isinstance(learned.get(HASH_ALGO_LABEL), str):  # how ingest checks the engine's hashes
        labels[HASH_ALGO_LABEL] = learned[HASH_ALGO_LABEL]
    return WorkerSpec(
        id=f"{name}.{namespace}", url=f"http://{_netloc(ip, port)}", engine=engine,
        model=model, role=role or WorkerRole.REGULAR, labels=labels, **fields,
    )


def _role(text: str) -> WorkerRole:
    try:
        return WorkerRole(text)
    except ValueError:
        raise SpecError(f"{PREFIX}role: unknown role {text!r}") from None


class PodTable:
    """The pods a watch has seen, by name, and the ``resourceVersion`` to resume from.

    Fed a list (:meth:`reset`) and then watch events (:meth:`apply`); :meth:`workers` maps
    them to specs. Events older than the pod already held are ignored, so a re-delivered
    event after a reconnect cannot roll a pod back.
    """

    def __init__(self, discovered_by: str = "") -> None:
        self.discovered_by = discovered_by
        self.resource_version = ""
        self._pods: dict[str, Mapping[str, Any]] = {}

    def __repr__(self) -> str:
        return f"PodTable(pods={len(self._pods)}, resource_version={self.resource_version!r})"

    def __len__(self) -> int:
        return len(self._pods)

    def reset(self, pods: Iterable[Mapping[str, Any]], resource_version: str) -> None:
        """A fresh list replaces everything known."""
        self._pods = {str(_field(p, "metadata", "name")): p for p in pods}
        self.resource_version = resource_version

    def apply(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """One watch event (``ADDED`` / ``MODIFIED`` / ``DELETED`` / ``BOOKMARK``); ``True``
        when the pods changed. Every event moves the resume point."""
        version = str(_field(obj, "metadata", "resourceVersion") or "")
        if version:
            self.resource_version = version
        if kind == "BOOKMARK":
            return False
        name = str(_field(obj, "metadata", "name") or "")
        if not name:
            return False
        if kind == "DELETED":
            return self._pods.pop(name, None) is not None
        held = self._pods.get(name)
        if held is not None and _newer(_field(held, "metadata", "resourceVersion"), version):
            return False
        self._pods[name] = obj
        return held != obj

    def pods(self) -> dict[str, Mapping[str, Any]]:
        """The pods held, by name."""
        return dict(self._pods)

    def outcomes(self, learned: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> dict[str, WorkerSpec | NotWorker]:
        """Every pod's outcome, by pod name (``learned``: what engines said, by pod name)."""
        learned = learned or {}
        return {name: worker_of(pod, self.discovered_by, learned.get(name))
                for name, pod in self._pods.items()}

    def workers(self, learned: Mapping[str, Mapping[str, Any]] | None = None
                ) -> dict[str, WorkerSpec]:
        """The Ready pods' specs, by worker id."""
        return {o.id: o for o in self.outcomes(learned).values() if isinstance(o, WorkerSpec)}


def _newer(held: object, incoming: str) -> bool:
    """``held`` is a later version than ``incoming``. resourceVersions are opaque strings;
    etcd-backed servers use integers, the only case compared (else the event wins)."""
    if isinstance(held, str) and held.isdigit() and incoming.isdigit():
        return int(held) > int(incoming)
    return False

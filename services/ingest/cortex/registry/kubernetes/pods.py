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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cortex.hashing import Engine
from cortex.registry.errors import SpecError
from cortex.registry.spec import WorkerRole, WorkerSpec

__all__ = ["PREFIX", "NotWorker", "PodTable", "worker_of"]

PREFIX = "cortex/"
"""Prefix of the annotations (and labels) that describe a worker pod."""

_DEFAULT_PORT = {Engine.SGLANG: 30000, Engine.VLLM: 8000}
_INTS = {"dp-size": "dp_size", "block-size": "block_size", "bootstrap-port": "bootstrap_port"}


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


def _ready(pod: Mapping[str, Any]) -> str | None:
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


def worker_of(pod: Mapping[str, Any], discovered_by: str = "") -> WorkerSpec | NotWorker:
    """The worker ``pod`` is, or why it is none. ``discovered_by`` is recorded in the
    spec's labels, so a discovery recognises the workers it registered."""
    name = str(_field(pod, "metadata", "name") or "")
    namespace = str(_field(pod, "metadata", "namespace") or "")
    described: dict[str, str] = {}
    for source in ("labels", "annotations"):  # annotations win
        for key, value in (_field(pod, "metadata", source) or {}).items():
            if isinstance(key, str) and key.startswith(PREFIX) and isinstance(value, str):
                described[key[len(PREFIX):]] = value.strip()
    try:
        spec = _spec(pod, name, namespace, described, discovered_by)
    except SpecError as exc:
        return NotWorker(name, str(exc), invalid=True)
    reason = _ready(pod)
    return spec if reason is None else NotWorker(name, reason)


def _spec(pod: Mapping[str, Any], name: str, namespace: str, described: Mapping[str, str],
          discovered_by: str) -> WorkerSpec:
    for required in ("engine", "model"):
        if not described.get(required):
            raise SpecError(f"{PREFIX}{required}: missing (an annotation or label)")
    try:
        engine = Engine(described["engine"])
    except ValueError:
        raise SpecError(f"{PREFIX}engine: unknown engine {described['engine']!r}") from None
    ip = str(_field(pod, "status", "podIP") or "0.0.0.0")  # validated with a placeholder
    port = _port(described["port"], "port") if "port" in described else _DEFAULT_PORT[engine]
    fields: dict[str, Any] = {}
    for key, attr in _INTS.items():
        if key in described:
            if not described[key].isdigit():
                raise SpecError(f"{PREFIX}{key}: {described[key]!r} is not a number")
            fields[attr] = int(described[key])
    for key, attr in (("kv-events-port", "kv_events"), ("replay-port", "replay")):
        if key in described:
            fields[attr] = f"tcp://{_netloc(ip, _port(described[key], key))}"
    labels = {"source": "kubernetes", "k8s.namespace": namespace, "k8s.pod": name,
              "k8s.node": str(_field(pod, "spec", "nodeName") or ""),
              "discovered-by": discovered_by}
    return WorkerSpec(
        id=f"{name}.{namespace}", url=f"http://{_netloc(ip, port)}", engine=engine,
        model=described["model"], role=_role(described.get("role", "regular")),
        topic=described.get("topic", ""), labels=labels, **fields,
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

    def outcomes(self) -> dict[str, WorkerSpec | NotWorker]:
        """Every pod's outcome, by pod name."""
        return {name: worker_of(pod, self.discovered_by) for name, pod in self._pods.items()}

    def workers(self) -> dict[str, WorkerSpec]:
        """The Ready pods' specs, by worker id."""
        return {o.id: o for o in self.outcomes().values() if isinstance(o, WorkerSpec)}


def _newer(held: object, incoming: str) -> bool:
    """``held`` is a later version than ``incoming``. resourceVersions are opaque strings;
    etcd-backed servers use integers, the only case compared (else the event wins)."""
    if isinstance(held, str) and held.isdigit() and incoming.isdigit():
        return int(held) > int(incoming)
    return False

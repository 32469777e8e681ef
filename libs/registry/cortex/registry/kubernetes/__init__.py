"""Kubernetes pod discovery: the Ready pods of a namespace, as registry leases.

- :func:`worker_of` / :class:`PodTable` — pods (the API's JSON) → worker specs (pure);
- :func:`plan` — what to register, renew and remove (pure);
- :class:`PodApi` — list + watch over the API (aiohttp);
- :class:`PodDiscovery` — the loops that keep the registry equal to the pods;
- ``cortex discover-pods`` (:mod:`cortex.registry.kubernetes.cli`).
"""

from cortex.registry.kubernetes.api import PodApi, WatchEvent
from cortex.registry.kubernetes.config import DiscoveryConfig
from cortex.registry.kubernetes.discovery import PodDiscovery
from cortex.registry.kubernetes.errors import (
    KubernetesError,
    KubernetesUnavailable,
    ResourceVersionGone,
)
from cortex.registry.kubernetes.pods import PREFIX, NotWorker, PodTable, worker_of
from cortex.registry.kubernetes.reconcile import REMOVAL_REASON, Plan, plan

__all__ = [
    "PREFIX",
    "REMOVAL_REASON",
    "DiscoveryConfig",
    "KubernetesError",
    "KubernetesUnavailable",
    "NotWorker",
    "Plan",
    "PodApi",
    "PodDiscovery",
    "PodTable",
    "ResourceVersionGone",
    "WatchEvent",
    "plan",
    "worker_of",
]

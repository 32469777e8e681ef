"""What can go wrong talking to the Kubernetes API, by who must react."""

from __future__ import annotations

from cortex.registry.errors import RegistryError

__all__ = ["KubernetesError", "KubernetesUnavailable", "ResourceVersionGone"]


class KubernetesError(RegistryError):
    """Base of the pod discovery's errors."""


class KubernetesUnavailable(KubernetesError):
    """The API server could not be reached, or refused (401 / 403: the service account's
    token or RBAC); the discovery retries with backoff and keeps the workers it knows."""


class ResourceVersionGone(KubernetesError):
    """``410 Gone``: the resume point is older than the server keeps; list again."""

"""The agent's Kubernetes API client: configuration, one shared connection, and a resilient list+watch.

- :mod:`nodeplug.kube.config`: where the API is (``--kubeconfig``, ``KUBECONFIG``, the in-cluster service account,
  or nowhere: single-node mode) and this node's name;
- :mod:`nodeplug.kube.client`: :class:`KubeClient`, lightkube's typed ``AsyncClient`` (``.api``) plus raw JSON
  requests, with the error tree ``KubeError`` > ``KubeUnavailable`` | ``KubeApiError``;
- :mod:`nodeplug.kube.watch`: :class:`ListWatch`, list + watch with resume, relist on 410, bookmarks and backoff.

The API server is a source of truth the agent follows, never a dependency it waits on (DESIGN.md rule 10): nothing
here blocks start-up, and a watch outlives any outage.
"""

from __future__ import annotations

from nodeplug.kube.client import KubeApiError, KubeClient, KubeError, KubeUnavailable, resource_path
from nodeplug.kube.config import KubeConfigError, KubeSource, node_name, resolve
from nodeplug.kube.watch import Backoff, Event, ListWatch, WatchStatus

__all__ = [
    "Backoff",
    "Event",
    "KubeApiError",
    "KubeClient",
    "KubeConfigError",
    "KubeError",
    "KubeSource",
    "KubeUnavailable",
    "ListWatch",
    "WatchStatus",
    "node_name",
    "resolve",
    "resource_path",
]

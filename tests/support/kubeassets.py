"""The Kubernetes binaries of ``KUBE_ASSETS`` for tests (:mod:`lab.kubeassets`), skipping where one is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.kubeassets import absent, binary, kube_assets, kubecache

__all__ = ["absent", "binary", "kube_assets", "kube_tool", "kubecache"]


def kube_tool(name: str) -> Path:
    """:func:`binary`, skipping the test, saying why, where ``name.xz`` is absent."""
    if reason := absent(name):
        pytest.skip(reason)
    return binary(name)

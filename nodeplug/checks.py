"""The doctor's vocabulary: a named check and its outcome.

Plugins contribute checks through ``<pkg>.doctor.checks(section, ctx)``; ``nodeplug doctor`` runs them in order and
prints one table row each. A check function returns a short detail on success and raises :class:`CheckFailed`
(or any exception) on failure; :class:`CheckSkipped` marks a check that does not apply here, and
:class:`CheckWarning` something to look at that is not a failure.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


class CheckFailed(Exception):
    """The check ran and found a problem; the message says what and what to do."""


class CheckSkipped(Exception):
    """The check does not apply (feature disabled, agent not running); the message says why."""


class CheckWarning(Exception):
    """Worth an operator's attention but not a failure (e.g. kubelet not running yet); the message says what."""


@dataclass(frozen=True)
class Check:
    group: str  # "kernel", "tools", "kubelet", "deviceplugin", "csi", "cni", ...
    name: str
    run: Callable[[], Awaitable[str]]


@dataclass(frozen=True)
class CheckResult:
    group: str
    name: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str
    seconds: float

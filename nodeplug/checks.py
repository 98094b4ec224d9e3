"""The doctor's vocabulary: a named check and its outcome.

Plugins contribute checks through their spec (:mod:`nodeplug.plugins`); ``nodeplug doctor`` runs them in order and
prints one table row each. A check function returns a short detail on success and raises :class:`CheckFailed`
(or any exception) on failure; :class:`CheckSkipped` marks a check that does not apply here, and
:class:`CheckWarning` something to look at that is not a failure.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path


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


def tool_check(group: str, tool: str) -> Check:
    """A check that ``tool`` is on PATH."""

    async def run() -> str:
        found = shutil.which(tool)
        if not found:
            raise CheckFailed(f"{tool} not found on PATH: install it on the node")
        return found

    return Check(group, tool, run)


def dirs_check(group: str, name: str, dirs: list[Path], root: Path) -> Check:
    """A check that the kubelet directories a plugin serves in exist under ``root``."""

    async def run() -> str:
        missing = [str(d) for d in dirs if not d.is_dir()]
        if missing:
            raise CheckFailed(f"missing under root {root}: {', '.join(missing)} (is kubelet installed here?)")
        return f"{len(dirs)} present"

    return Check(group, name, run)

"""CNI errors: one exception type carrying a spec error code, rendered as the spec's error JSON.

Every failure the runtime can see is a :class:`CniError`. Its ``code`` is one of the well-known codes of the CNI spec
1.1.0 ("Error" section) or a plugin-specific code of 100 and above; ``msg`` is a short summary and ``details`` says
which thing was at fault and what to do. :meth:`CniError.to_json` gives exactly what goes to stdout::

    {"cniVersion": "1.1.0", "code": 7, "msg": "invalid network config", "details": "mtu: expected ..."}

This module is on the entry point's start-up path: standard library only.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up path: every import costs)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# Well-known error codes (CNI spec 1.1.0, "Error"); 1-99 are reserved for the spec, 100+ are plugin-specific.
INCOMPATIBLE_VERSION = 1
UNSUPPORTED_FIELD = 2
UNKNOWN_CONTAINER = 3
INVALID_ENVIRONMENT = 4
IO_FAILURE = 5
DECODE_FAILURE = 6
INVALID_NETWORK_CONFIG = 7
TRY_AGAIN_LATER = 11
PLUGIN_NOT_AVAILABLE = 50  # STATUS: the plugin cannot service ADD requests
LIMITED_CONNECTIVITY = 51  # STATUS: not available, and existing containers may have limited connectivity

# Plugin-specific codes (100 and above).
INTERNAL = 999  # an unexpected failure (a bug, or a kernel call failing unexpectedly); 999 as the Go libcni
DATAPLANE = 101  # netlink / nftables work failed
IPAM_EXHAUSTED = 102  # no address left in a range set
IPAM_STORE = 103  # the lease store cannot be used
DELEGATE = 104  # a delegated IPAM plugin failed without a spec error of its own

_SUMMARIES = {
    INCOMPATIBLE_VERSION: "incompatible CNI version",
    UNSUPPORTED_FIELD: "unsupported field in network configuration",
    UNKNOWN_CONTAINER: "container unknown or does not exist",
    INVALID_ENVIRONMENT: "invalid environment variables",
    IO_FAILURE: "I/O failure",
    DECODE_FAILURE: "failed to decode content",
    INVALID_NETWORK_CONFIG: "invalid network config",
    TRY_AGAIN_LATER: "try again later",
    PLUGIN_NOT_AVAILABLE: "plugin not available",
    LIMITED_CONNECTIVITY: "plugin not available, existing containers may have limited connectivity",
    INTERNAL: "internal error",
    DATAPLANE: "dataplane setup failed",
    IPAM_EXHAUSTED: "no IP addresses available",
    IPAM_STORE: "IPAM store unavailable",
    DELEGATE: "delegated plugin failed",
}


def summary(code: int) -> str:
    """The default ``msg`` for a code."""
    return _SUMMARIES.get(code, "error")


class CniError(Exception):
    """A failure reported to the runtime as ``{"code", "msg", "details"}`` with a non-zero exit."""

    def __init__(self, code: int, msg: str | None = None, details: str = "") -> None:
        self.code = int(code)
        self.msg = msg if msg is not None else summary(self.code)
        self.details = details
        super().__init__(f"{self.msg}: {details}" if details else self.msg)

    def to_dict(self, cni_version: str) -> dict[str, Any]:
        out: dict[str, Any] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out

    def to_json(self, cni_version: str = "1.1.0") -> str:
        import json  # only when an error is printed: keeps json off the entry point's start-up path

        return json.dumps(self.to_dict(cni_version))

    @classmethod
    def from_dict(cls, data: Any, who: str = "plugin") -> CniError:
        """Rebuild an error a delegated plugin (or the agent) printed; keeps its code, msg and details."""
        if not isinstance(data, dict) or not isinstance(data.get("code"), int):
            return cls(DELEGATE, details=f"{who} failed with an unreadable error: {str(data)[:200]}")
        return cls(data["code"], str(data.get("msg", "")) or None, str(data.get("details", "")))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CniError):
            return NotImplemented
        return (self.code, self.msg, self.details) == (other.code, other.msg, other.details)

    def __hash__(self) -> int:
        return hash((self.code, self.msg, self.details))

    def __repr__(self) -> str:
        return f"CniError({self.code}, {self.msg!r}, {self.details!r})"


def quietly(fn: Callable[..., object], *args: Any) -> None:
    """Run an undo step (``exit_stack.callback(quietly, fn, *args)``): its own failure must not hide the error that
    caused the rollback."""
    try:  # noqa: SIM105 - no contextlib on the entry point's start-up path
        fn(*args)
    except Exception:
        pass  # by design: the error being handled is the one to report

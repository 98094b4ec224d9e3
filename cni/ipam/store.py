"""The lease store protocol, and an in-memory store for unit tests.

A store holds one network's leases. All work happens inside :meth:`Store.transaction`, which is exclusive across every
process sharing the store (SQLite: ``BEGIN IMMEDIATE``), so the allocator's read-then-reserve is atomic. A
transaction offers a handful of methods, like host-local's backend:

- ``reserve(lease) -> bool``: False when the address is already leased;
- ``leases() -> list[Lease]``: every lease;
- ``leases_of(container_id, ifname) -> list[Lease]``;
- ``release_of(container_id, ifname) -> list[Lease]``: removes and returns them;
- ``release(ip) -> None``;
- ``last_reserved(range_key) -> str | None`` / ``set_last_reserved(range_key, ip)``: where the next search starts.

Addresses are stored as their canonical text (``str(ipaddress.ip_address(...))``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import NamedTuple, Protocol


class Lease(NamedTuple):
    ip: str
    container_id: str
    ifname: str
    range_key: str


class Txn(Protocol):
    def reserve(self, lease: Lease) -> bool: ...

    def leases(self) -> list[Lease]: ...

    def leases_of(self, container_id: str, ifname: str) -> list[Lease]: ...

    def release_of(self, container_id: str, ifname: str) -> list[Lease]: ...

    def release(self, ip: str) -> None: ...

    def last_reserved(self, range_key: str) -> str | None: ...

    def set_last_reserved(self, range_key: str, ip: str) -> None: ...


class Store(Protocol):
    def transaction(self) -> contextlib.AbstractContextManager[Txn]: ...

    def close(self) -> None: ...


class MemoryTxn:
    def __init__(self, leases: dict[str, Lease], last: dict[str, str]) -> None:
        self._leases = leases
        self._last = last

    def reserve(self, lease: Lease) -> bool:
        if lease.ip in self._leases:
            return False
        self._leases[lease.ip] = lease
        return True

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def leases_of(self, container_id: str, ifname: str) -> list[Lease]:
        return [x for x in self._leases.values() if x.container_id == container_id and x.ifname == ifname]

    def release_of(self, container_id: str, ifname: str) -> list[Lease]:
        gone = self.leases_of(container_id, ifname)
        for x in gone:
            del self._leases[x.ip]
        return gone

    def release(self, ip: str) -> None:
        self._leases.pop(ip, None)

    def last_reserved(self, range_key: str) -> str | None:
        return self._last.get(range_key)

    def set_last_reserved(self, range_key: str, ip: str) -> None:
        self._last[range_key] = ip


class MemoryStore:
    """A dict store with the same transaction semantics (all-or-nothing, exclusive) for pure-logic tests."""

    def __init__(self) -> None:
        self.leases: dict[str, Lease] = {}
        self.last: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Txn]:
        with self._lock:
            leases, last = dict(self.leases), dict(self.last)
            yield MemoryTxn(leases, last)
            self.leases, self.last = leases, last

    def close(self) -> None:
        pass

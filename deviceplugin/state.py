"""The device table of one resource: which devices kubelet is told about, and whether each is healthy.

Pure: the caller feeds it discovery results, health-command outcomes and the time; it answers with the listing
(replicas expanded) and says whether anything kubelet sees has changed.

A device is unhealthy while any reason holds, and healthy again when none does:

- ``gone``: its glob node or sysfs entry vanished. It stays listed (so kubelet sees it unhealthy, and the same ID
  becomes healthy again if it comes back) until it has been gone ``forget_after_seconds``; then it leaves the list.
- ``missing``: discovery found it but some of its device nodes do not exist.
- ``health``: its health command failed or timed out; with a health command configured, a newly found device
  counts as unhealthy until its first check has passed (kubelet never gets a device nobody has checked).

A replica *held* elsewhere (prepared for a DRA claim) is listed unhealthy to kubelet with the hold as its reason, so
the device manager does not hand it out; a hold naming the physical device (a claim recorded before replicas were
offered one by one) holds every replica of it. Its own health (:meth:`DeviceTable.reason`) is not affected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deviceplugin.discovery import Device, natural_key

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
NOT_CHECKED = "health command not run yet"


@dataclass(frozen=True)
class Listed:
    """One entry of the ListAndWatch answer: a replica of a physical device."""

    id: str
    device: Device
    healthy: bool
    reason: str = ""

    @property
    def health(self) -> str:
        return HEALTHY if self.healthy else UNHEALTHY


@dataclass(frozen=True)
class Snapshot:
    """The listing as of one moment, indexed for the allocation policy. Nothing in it ever changes (the table builds
    a new one on every change), so work off the event loop can read it while the loop goes on updating the table.

    An ID's *rank* is its position in the listing: natural order of the physical devices, then replica number. The
    replicas of one device are ``replicas`` consecutive ranks, so ``rank // replicas`` numbers the device.
    """

    listing: tuple[Listed, ...] = ()
    replicas: int = 1
    rank: Mapping[str, int] = field(default_factory=dict)
    healthy_rank: Mapping[str, int] = field(default_factory=dict)  # the healthy IDs only
    numa: tuple[int | None, ...] = ()  # by rank

    @classmethod
    def of(cls, listing: tuple[Listed, ...], replicas: int) -> Snapshot:
        rank = {e.id: i for i, e in enumerate(listing)}
        healthy = {e.id: i for i, e in enumerate(listing) if e.healthy}
        return cls(listing, replicas, rank, healthy, tuple(e.device.numa for e in listing))

    def get(self, replica_id: str) -> Listed | None:
        i = self.rank.get(replica_id)
        return None if i is None else self.listing[i]


def replica_ids(dev_id: str, replicas: int) -> list[str]:
    return [dev_id] if replicas == 1 else [f"{dev_id}::{k}" for k in range(replicas)]


def physical_id(replica_id: str) -> str:
    return replica_id.split("::", 1)[0]


class DeviceTable:
    def __init__(self, replicas: int = 1, forget_after: float = 300.0, checked: bool = False) -> None:
        self.replicas = replicas
        self.forget_after = forget_after
        self.checked = checked
        self._devices: dict[str, Device] = {}
        self._gone_since: dict[str, float] = {}
        self._command: dict[str, str] = {}  # physical id -> why its health command failed
        self._snapshot = Snapshot(replicas=replicas)
        self._held: dict[str, str] = {}  # replica or physical id -> why it is not allocatable here (a DRA claim's)

    # ------------------------------------------------------------ inputs

    def update(self, discovered: list[Device], now: float) -> bool:
        """Apply a discovery result; True when the listing changed."""
        found = {d.id: d for d in discovered}
        for dev_id in self._devices:
            if dev_id not in found:
                self._gone_since.setdefault(dev_id, now)
        for dev_id, dev in found.items():
            if self.checked and dev_id not in self._devices:
                self._command[dev_id] = NOT_CHECKED
            self._devices[dev_id] = dev
            self._gone_since.pop(dev_id, None)
        self._forget(now)
        return self._rebuild()

    def expire(self, now: float) -> bool:
        """Forget devices gone longer than ``forget_after``; True when the listing changed."""
        self._forget(now)
        return self._rebuild()

    def next_expiry(self) -> float | None:
        return min(self._gone_since.values()) + self.forget_after if self._gone_since else None

    def set_command_health(self, dev_id: str, failure: str | None) -> bool:
        """Record a health-command outcome (``None`` = passed); True when the listing changed."""
        if dev_id not in self._devices:
            return False
        if failure is None:
            self._command.pop(dev_id, None)
        else:
            self._command[dev_id] = failure
        return self._rebuild()

    def set_held(self, held: dict[str, str]) -> bool:
        """Replicas held elsewhere (replica id, or a physical id for all its replicas -> why): listed unhealthy to
        kubelet, with that reason, while held; their health of their own (:meth:`reason`) is unchanged. True when
        the listing changed."""
        if held == self._held:
            return False
        self._held = dict(held)
        return self._rebuild()

    # ------------------------------------------------------------ answers

    @property
    def listing(self) -> tuple[Listed, ...]:
        return self._snapshot.listing

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def get(self, replica_id: str) -> Listed | None:
        return self._snapshot.get(replica_id)

    def devices(self) -> list[Device]:
        """Physical devices present now (the ones a health command is run for)."""
        return [d for i, d in self._devices.items() if i not in self._gone_since]

    def reason(self, dev_id: str) -> str:
        if dev_id in self._gone_since:
            return "device is gone from the node"
        dev = self._devices.get(dev_id)
        if dev is not None and dev.missing:
            return "device node missing: " + ", ".join(dev.missing)
        return self._command.get(dev_id, "")

    # ------------------------------------------------------------ internals

    def _forget(self, now: float) -> None:
        for dev_id, since in list(self._gone_since.items()):
            if now - since >= self.forget_after:
                del self._gone_since[dev_id]
                del self._devices[dev_id]
                self._command.pop(dev_id, None)

    def _rebuild(self) -> bool:
        entries: list[Listed] = []
        for dev_id in sorted(self._devices, key=natural_key):
            dev = self._devices[dev_id]
            own = self.reason(dev_id) or self._held.get(dev_id, "")
            for rid in replica_ids(dev_id, self.replicas):
                why = own or self._held.get(rid, "")
                entries.append(Listed(rid, dev, not why, why))
        listing = tuple(entries)
        changed = _visible(listing) != _visible(self._snapshot.listing)
        self._snapshot = Snapshot.of(listing, self.replicas)
        return changed


def _visible(listing: tuple[Listed, ...]) -> list[tuple[str, bool, int | None]]:
    """What kubelet sees of a listing: ID, health and NUMA node."""
    return [(e.id, e.healthy, e.device.numa) for e in listing]

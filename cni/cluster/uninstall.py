"""Who may change this node's cluster network, and how ``nodeplug install-cni --uninstall`` takes it away.

A running agent must keep the network through a restart or an upgrade (it never removes anything on SIGTERM), so
it cannot tell an uninstall from a restart by itself. Two files in the runtime directory settle it (paths under the
agent's root):

``/run/nodeplug/cluster-network.lock``
    held (``flock``, exclusive) by whoever changes the kernel state of the cluster network: the agent while it
    manages it, ``install-cni --uninstall`` while it removes it. The kernel drops the lock when its holder dies, so
    a ``kill -9`` never leaves it stuck. The holder writes a :class:`Record` into it: which node, which network
    namespace, the route protocol and the subnets file, so that an uninstall run when no agent is there removes
    exactly what the last agent owned.
``/run/nodeplug/cluster-network.uninstall``
    the request: written by ``install-cni --uninstall``, removed by the next ``install-cni`` (install). While it
    exists the agent does not manage the cluster network: it notices the marker within :data:`POLL_SECONDS`, waits
    for the pass under way, removes what it owns (:mod:`cni.cluster.teardown`), releases the lock and stays out,
    across restarts too, until the marker is gone. ``install-cni --uninstall`` waits for the lock (the agent done),
    then runs the same removal itself, which finds nothing left when the agent did it, or does the work when no
    agent was running.

The runtime directory is a tmpfs on most hosts: a reboot clears the marker, as it clears the pod network itself.

Standard library only: ``install-cni`` imports this whatever it does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Route protocol numbers the kernel and the routing daemons use (iproute2's rt_protos registry): routes of these are
# never nodeplug's, so neither the config nor a lock record may name one (an uninstall deletes by protocol).
RESERVED_PROTOCOLS = {
    0: "unspec", 1: "redirect", 2: "kernel", 3: "boot", 4: "static", 8: "gated", 9: "ra", 10: "mrt", 11: "zebra",
    12: "bird", 13: "dnrouted", 14: "xorp", 15: "ntk", 16: "dhcp", 17: "mrouted", 18: "keepalived", 42: "babel",
    99: "openr", 186: "bgp", 187: "isis", 188: "ospf", 189: "rip", 192: "eigrp",
}  # fmt: skip


def ours(protocol: int) -> bool:
    """Whether ``protocol`` is a route protocol number nodeplug may own."""
    return 1 <= protocol <= 254 and protocol not in RESERVED_PROTOCOLS


LOCK = "/run/nodeplug/cluster-network.lock"
MARKER = "/run/nodeplug/cluster-network.uninstall"
FORMAT = 1
MAX_BYTES = 4096
POLL_SECONDS = 0.2


def this_netns() -> str:
    """The calling thread's network namespace as ``<device>:<inode>`` (what ``ip netns identify`` compares)."""
    st = os.stat("/proc/thread-self/ns/net")
    return f"{st.st_dev}:{st.st_ino}"


@dataclass(frozen=True)
class Record:
    """What the holder of the lock manages."""

    node: str
    netns: str
    route_protocol: int
    subnets_file: str
    pid: int = 0

    def dumps(self) -> bytes:
        doc = {"format": FORMAT, "node": self.node, "netns": self.netns, "routeProtocol": self.route_protocol,
               "subnetsFile": self.subnets_file, "pid": self.pid}  # fmt: skip
        return (json.dumps(doc, sort_keys=True) + "\n").encode()


def parse_record(data: bytes) -> Record | None:
    """The record in ``data``; None for anything that is not one (an empty file: a holder killed while writing)."""
    if not data or len(data) > MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    node, netns, proto, subnets, pid = (doc.get(k) for k in ("node", "netns", "routeProtocol", "subnetsFile", "pid"))
    if not isinstance(node, str) or not isinstance(netns, str) or not isinstance(subnets, str):
        return None
    if not subnets.startswith("/") or "\0" in subnets or ".." in subnets.split("/") or len(node) > 253:
        return None
    if isinstance(proto, bool) or not isinstance(proto, int) or not ours(proto):
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        return None
    return Record(node, netns, proto, subnets, pid)


def read_record(path: Path) -> Record | None:
    """The record of the lock's last holder, read without taking the lock; None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return parse_record(os.read(fd, MAX_BYTES + 1))
    finally:
        os.close(fd)


class Lock:
    """The exclusive right to change the cluster network's kernel state (an ``flock`` on :data:`LOCK`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; True when held (now or already)."""
        if self.fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            # the previous holder may have removed the file between our open and our flock: then this lock is on a
            # file nobody else will open; take the one at the path instead
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)
        return False

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lock; True when held."""
        deadline = time.monotonic() + timeout
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def write(self, record: Record) -> None:
        assert self.fd is not None, "write the record only while holding the lock"
        data = record.dumps()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def read(self) -> Record | None:
        assert self.fd is not None
        return parse_record(os.pread(self.fd, MAX_BYTES + 1, 0))

    def remove(self) -> None:
        """Delete the lock file while holding it (the end of an uninstall); a later taker makes a new one."""
        assert self.fd is not None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def request(marker: Path) -> bool:
    """Ask for the cluster network to be removed and left alone; False when it was asked already."""
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    doc = {"format": FORMAT, "requested": time.time(), "by": "nodeplug install-cni --uninstall"}
    tmp.write_bytes((json.dumps(doc) + "\n").encode())
    os.replace(tmp, marker)
    return True


def requested(marker: Path) -> bool:
    return os.path.lexists(marker)


def clear(marker: Path) -> bool:
    """Withdraw the request (an install); False when there was none."""
    try:
        os.unlink(marker)
    except FileNotFoundError:
        return False
    return True
